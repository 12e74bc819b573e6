package pgq_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgq"
	"github.com/perspectives-go/perspectives/internal/pgtest"
)

// The arrays Args converts reach the server as the same values in every query exec mode:
// pgx's default mode (binary), exec and simple_protocol (text, written by the literals).
func TestArgsArraysRoundTripInEveryExecMode(t *testing.T) {
	ctx := context.Background()
	ids := []uuid.UUID{uuid.New(), uuid.Nil, uuid.MustParse("ffffffff-0000-4abc-8def-0123456789ab")}
	names := []string{"plain", "", `quo"te`, `back\slash`, "comma,brace{}", "NULL", " spaced ", "ünïcode\nline"}
	for _, mode := range []string{"", "exec", "simple_protocol"} {
		t.Run("mode="+mode, func(t *testing.T) {
			conn, err := pgx.Connect(ctx, pgtest.WithExecMode(pgtest.ServerURL(), mode))
			require.NoError(t, err)
			defer conn.Close(ctx)

			var gotIDs []uuid.UUID
			var gotNames []string
			var n int
			require.NoError(t, conn.QueryRow(ctx, `SELECT $1::uuid[], $2::text[], cardinality($2::text[])`,
				pgq.Args([]any{ids, names})...).Scan(&gotIDs, &gotNames, &n))
			require.Equal(t, ids, gotIDs)
			require.Equal(t, names, gotNames)
			require.Equal(t, len(names), n, "every string is one element")

			var idsNull, namesNull bool
			var emptyIDs, emptyNames int
			require.NoError(t, conn.QueryRow(ctx, `SELECT $1::uuid[] IS NULL, $2::text[] IS NULL, cardinality($3::uuid[]), cardinality($4::text[])`,
				pgq.Args([]any{[]uuid.UUID(nil), []string(nil), []uuid.UUID{}, []string{}})...).Scan(&idsNull, &namesNull, &emptyIDs, &emptyNames))
			require.True(t, idsNull, "a nil []uuid.UUID is NULL")
			require.True(t, namesNull, "a nil []string is NULL")
			require.Zero(t, emptyIDs, "an empty []uuid.UUID is an empty array")
			require.Zero(t, emptyNames, "an empty []string is an empty array")

			// Inferred from the statement, without a cast.
			var found int
			require.NoError(t, conn.QueryRow(ctx, `SELECT count(*)::int FROM unnest($1::uuid[]) AS u(id) WHERE id = ANY($2)`,
				pgq.Args([]any{ids, ids[:2]})...).Scan(&found))
			require.Equal(t, 2, found)
		})
	}
}

// The text form is what PostgreSQL's array input reads back: checked here without a server
// for the characters that need escaping.
func TestArgsTextLiterals(t *testing.T) {
	args := pgq.Args([]any{[]uuid.UUID{uuid.MustParse("00112233-4455-6677-8899-aabbccddeeff")}, []string{`a"b`, `c\d`}, 7, "x"})
	ids, ok := args[0].(pgtype.TextValuer)
	require.True(t, ok, "a []uuid.UUID becomes a TextValuer: %T", args[0])
	txt, err := ids.TextValue()
	require.NoError(t, err)
	require.Equal(t, pgtype.Text{String: "{00112233-4455-6677-8899-aabbccddeeff}", Valid: true}, txt)
	names, ok := args[1].(pgtype.TextValuer)
	require.True(t, ok, "a []string becomes a TextValuer: %T", args[1])
	txt, err = names.TextValue()
	require.NoError(t, err)
	require.Equal(t, pgtype.Text{String: `{"a\"b","c\\d"}`, Valid: true}, txt)
	require.Equal(t, 7, args[2], "other arguments are passed as they are")
	require.Equal(t, "x", args[3])
}
