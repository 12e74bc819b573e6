package worker_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/worker"
)

// The verdict is the most urgent state that holds: parked before no live instance before
// failing before catching up before applying before idle.
func TestBuildStatusHealth(t *testing.T) {
	t.Parallel()
	caughtUp := worker.Build{CatchUpDone: true}
	for _, tc := range []struct {
		b    worker.BuildStatus
		want worker.Health
	}{
		{worker.BuildStatus{Build: caughtUp, LiveInstances: 1}, worker.HealthIdle},
		{worker.BuildStatus{Build: caughtUp}, worker.HealthIdleNoInstance},
		{worker.BuildStatus{Build: caughtUp, LiveInstances: 1, Queued: 3}, worker.HealthApplying},
		{worker.BuildStatus{LiveInstances: 1, Queued: 3}, worker.HealthCatchingUp},
		{worker.BuildStatus{LiveInstances: 1, Queued: 3, Failing: 1}, worker.HealthRetrying},
		{worker.BuildStatus{Build: caughtUp, Queued: 3, Failing: 1}, worker.HealthStuckNoInstance},
		{worker.BuildStatus{}, worker.HealthStuckNoInstance},
		{worker.BuildStatus{Build: caughtUp, Failing: 1}, worker.HealthRetrying},
		{worker.BuildStatus{Queued: 3, Failing: 1, Parked: 2}, worker.HealthStuckParked},
	} {
		require.Equal(t, tc.want, tc.b.Health(), "%+v", tc.b)
	}
}
