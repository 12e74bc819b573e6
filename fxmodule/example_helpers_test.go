package fxmodule_test

// databaseURL is the application's database; in these examples, the test database, on a
// direct connection (the examples migrate, which a pooler refuses).
func databaseURL() string { return testDB.DirectURL }
