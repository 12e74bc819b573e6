package worker_test

// pooledDatabaseURL is the application's database through its connection pooler (PgBouncer
// in transaction mode); in these examples, the test database, through the tests' PgBouncer
// when they run behind one.
func pooledDatabaseURL() string { return testDB.URL }
