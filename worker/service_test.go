package worker

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

// A graceful stop: Stop cancels stopping at once and waits for the statement under way,
// which ends by itself; ctx is not cancelled while Stop's context lasts.
func TestServiceStopWaitsForTheStatementUnderWay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s service
		require.NoError(t, s.Start(context.Background()))
		var hardStopped bool
		require.True(t, s.Go(func(ctx, stopping context.Context) {
			<-stopping.Done()
			time.Sleep(3 * time.Second) // the statement under way, bounded by itself
			hardStopped = ctx.Err() != nil
		}))
		began := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		require.NoError(t, s.Stop(ctx))
		require.Equal(t, 3*time.Second, time.Since(began), "Stop waited for the statement, no longer")
		require.False(t, hardStopped, "ctx is cancelled only when Stop's context ends")
	})
}

// A hard stop: when Stop's context ends first, ctx is cancelled, and Stop returns once the
// goroutine has ended: at the deadline for a statement under ctx, at the deadline plus what
// is left of a statement bounded by a timeout of its own.
func TestServiceStopHonoursItsDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var s service
		require.NoError(t, s.Start(context.Background()))
		ended := make(chan string, 2)
		s.Go(func(ctx, _ context.Context) { // a statement under ctx
			<-ctx.Done()
			ended <- "under ctx"
		})
		s.Go(func(_, stopping context.Context) { // a statement of 5s, let finish
			time.Sleep(5 * time.Second)
			ended <- "bounded"
		})
		began := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		err := s.Stop(ctx)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, 5*time.Second, time.Since(began), "the deadline plus what was left of the bounded statement")
		require.Len(t, ended, 2, "no goroutine outlives Stop")
		require.Equal(t, "under ctx", <-ended, "cancelled at the deadline")
	})
}

// Start, Go and Stop in every order: Stop is idempotent and safe before Start; a stopped
// service starts nothing; Start's context does not end the service.
func TestServiceLifecycle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var never service
		require.False(t, never.Go(func(_, _ context.Context) {}), "not started: nothing runs")
		require.NoError(t, never.Stop(context.Background()))
		require.ErrorIs(t, never.Start(context.Background()), errServiceStopped)

		var s service
		startCtx, cancelStart := context.WithCancel(context.Background())
		require.NoError(t, s.Start(startCtx))
		require.Error(t, s.Start(startCtx), "started twice")
		cancelStart()
		ran := make(chan error, 1)
		require.True(t, s.Go(func(ctx, stopping context.Context) {
			<-stopping.Done()
			ran <- ctx.Err()
		}))
		time.Sleep(time.Hour)
		synctest.Wait()
		require.Empty(t, ran, "Start's context ended: the service runs on")
		require.NoError(t, s.Stop(context.Background()))
		require.NoError(t, <-ran, "stopped gracefully: ctx was not cancelled while it ran")
		require.NoError(t, s.Stop(context.Background()), "idempotent")
		require.False(t, s.Go(func(_, _ context.Context) {}), "stopped: nothing runs")
		require.ErrorIs(t, s.Start(context.Background()), errServiceStopped)
	})
}
