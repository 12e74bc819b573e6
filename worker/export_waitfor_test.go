package worker

import (
	"context"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
)

// WaitOptions are WaitFor's timings, for tests: zero fields take WaitFor's defaults.
type WaitOptions struct {
	Recheck          time.Duration        // the safety re-check while listening
	PollMin, PollMax time.Duration        // the poll delays without LISTEN
	PollOnly         bool                 // poll even where LISTEN works
	Checked          func(listening bool) // called after every check
}

// WaitForWith is WaitFor with o's timings.
func WaitForWith(ctx context.Context, pool *pgxpool.Pool, perspectiveName string, streamID, eventID uuid.UUID, o WaitOptions) error {
	return waitFor(ctx, pool, perspectiveName, streamID, eventID, waitOptions{
		recheck: o.Recheck, pollMin: o.PollMin, pollMax: o.PollMax, pollOnly: o.PollOnly, checked: o.Checked,
	})
}
