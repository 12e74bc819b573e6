package worker

//go:generate go tool moq -rm -out ../mocks/store.go -pkg mocks . Store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
)

// Store is the worker's access to the database: the generated queries, and transactions
// over them. The worker holds no SQL of its own; tests replace the Store with a mock.
type Store interface {
	db.Querier
	// InTx runs fn in one transaction: committed when fn returns nil, rolled back otherwise.
	InTx(ctx context.Context, fn func(q db.Querier) error) error
	// Listen subscribes to the notification every committed Append sends and calls notify
	// once subscribed and then for each notification, until ctx ends or the connection fails.
	Listen(ctx context.Context, notify func()) error
}

// pgStore is the Store on a pgx pool.
type pgStore struct {
	*db.Queries
	pool *pgxpool.Pool
}

func newPGStore(pool *pgxpool.Pool) *pgStore {
	return &pgStore{Queries: db.New(pool), pool: pool}
}

// Listen holds one connection of its own (taken out of the pool: a listening session must
// not be handed to other users) for as long as it listens.
func (s *pgStore) Listen(ctx context.Context, notify func()) error {
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	conn := pc.Hijack()
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if err := db.New(conn).QueueListen(ctx); err != nil {
		return err
	}
	notify() // events appended before the subscription took effect
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		notify()
	}
}

func (s *pgStore) InTx(ctx context.Context, fn func(q db.Querier) error) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return fn(db.New(tx)) })
}
