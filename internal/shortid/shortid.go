// Package shortid shortens UUIDs for people to read, in the demo's output and on the
// dashboard.
//
// The first 12 hex digits of a UUIDv7 are its time in milliseconds, so its first 8 change
// only every 65.5 seconds: IDs made together look alike there. Its last 12 hex digits are
// random bits, which tell apart even IDs made in the same millisecond: String shows those.
package shortid

import (
	"encoding/hex"

	"github.com/google/uuid"
)

// String is "…" and the last 12 hex digits of id, as its canonical form ends
// ("0193d6a2-7c1e-7b3f-9a41-5e2f8c0d1b6a" is "…5e2f8c0d1b6a"). Show the full ID wherever a
// person may copy it into a command (a table, a title attribute); String is for reading.
func String(id uuid.UUID) string {
	return "…" + hex.EncodeToString(id[10:])
}
