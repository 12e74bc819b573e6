package worker

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// A WaitFor checks on a notification, even one whose session was lost before the WaitFor
// took it, and when a session newly serves it; not when nothing changed or no session
// serves it.
func TestUnitWaitForChecksOnANotificationOrANewSession(t *testing.T) {
	lost := errors.New("session lost")
	for _, c := range []struct {
		name    string
		nt      notice
		session uint64
		due     bool
	}{
		{"notified", notice{notified: true, session: 3}, 3, true},
		{"notified, then the session lost", notice{notified: true, err: lost}, 3, true},
		{"a new session", notice{session: 4}, 3, true},
		{"the first session", notice{session: 1}, 0, true},
		{"nothing new", notice{session: 3}, 3, false},
		{"the session lost", notice{err: lost}, 3, false},
		{"no session yet", notice{}, 0, false},
	} {
		due, session := checkDue(c.nt, c.session)
		require.Equal(t, c.due, due, c.name)
		require.Equal(t, c.nt.session, session, c.name)
	}
}
