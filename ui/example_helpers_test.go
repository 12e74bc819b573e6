package ui_test

// databaseURL is the application's database; in these examples, the test database.
func databaseURL() string { return testDB.URL }
