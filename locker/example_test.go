package locker_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/locker"
)

// databaseURL is the application's database; in these examples, the test database.
func databaseURL() string { return testDB.URL }

// Take a stream lock, keep it alive, release it.
func ExamplePostgres() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL()) // the application's (migrated) database
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	lk, err := locker.NewPostgres(pool, locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 10 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	order, me, other := uuid.New(), uuid.New(), uuid.New()

	ok, err := lk.TryAcquire(ctx, order, "OrderPerspective", me, locker.ReasonRewind)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("acquired:", ok)

	ok, _ = lk.TryAcquire(ctx, order, "OrderPerspective", other, locker.ReasonRewind)
	fmt.Println("another instance acquired:", ok)

	held, _ := lk.Renew(ctx, order, "OrderPerspective", me) // a keepalive calls this every KeepAliveInterval
	fmt.Println("still held after renew:", held)

	if err := lk.Release(ctx, order, "OrderPerspective", me); err != nil {
		log.Fatal(err)
	}
	ok, _ = lk.TryAcquire(ctx, order, "OrderPerspective", other, locker.ReasonRewind)
	fmt.Println("another instance acquired after release:", ok)
	// Output:
	// acquired: true
	// another instance acquired: false
	// still held after renew: true
	// another instance acquired after release: true
}

// Options are validated: KeepAliveInterval must be less than LockTimeout/2.
func ExampleOptions_Validate() {
	err := locker.Options{LockTimeout: 10 * time.Second, KeepAliveInterval: 5 * time.Second}.Validate()
	fmt.Println(err)
	// Output: invalid lock options: KeepAliveInterval (5s) must be less than LockTimeout/2 (LockTimeout is 10s)
}
