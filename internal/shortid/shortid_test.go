package shortid_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/shortid"
)

func TestStringIsTheCanonicalFormsTail(t *testing.T) {
	t.Parallel()
	for range 100 {
		id := uuid.Must(uuid.NewV7())
		s := shortid.String(id)
		require.Equal(t, "…"+id.String()[24:], s)
		require.True(t, strings.HasSuffix(id.String(), strings.TrimPrefix(s, "…")))
	}
	require.Equal(t, "…000000000000", shortid.String(uuid.Nil))
}

// TestIDsOfTheSameMillisecondDiffer makes UUIDv7s until two share their millisecond (their
// first 12 hex digits, so their first 8 too) and checks that their short forms differ.
func TestIDsOfTheSameMillisecondDiffer(t *testing.T) {
	t.Parallel()
	seen := map[string]uuid.UUID{}
	sameMs := 0
	prev := uuid.Must(uuid.NewV7())
	for range 10000 {
		id := uuid.Must(uuid.NewV7())
		s := shortid.String(id)
		if other, ok := seen[s]; ok {
			t.Fatalf("%s and %s have the same short form %s", other, id, s)
		}
		seen[s] = id
		if id.String()[:13] == prev.String()[:13] { // the same 48-bit millisecond
			sameMs++
			require.Equal(t, id.String()[:8], prev.String()[:8])
			require.NotEqual(t, shortid.String(id), shortid.String(prev))
		}
		prev = id
	}
	require.Positive(t, sameMs, "no two of 10000 UUIDv7s were made in the same millisecond")
}

func ExampleString() {
	id := uuid.MustParse("0193d6a2-7c1e-7b3f-9a41-5e2f8c0d1b6a")
	fmt.Println(shortid.String(id))
	// Output: …5e2f8c0d1b6a
}
