package worker

//go:generate go tool moq -rm -out ../mocks/store.go -pkg mocks . Store

import (
	"context"

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
}

// pgStore is the Store on a pgx pool.
type pgStore struct {
	*db.Queries
	pool *pgxpool.Pool
}

func newPGStore(pool *pgxpool.Pool) *pgStore {
	return &pgStore{Queries: db.New(pool), pool: pool}
}

func (s *pgStore) InTx(ctx context.Context, fn func(q db.Querier) error) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return fn(db.New(tx)) })
}
