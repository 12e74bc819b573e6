package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// instrumentationName names the meter and the tracer.
const instrumentationName = "github.com/perspectives-go/perspectives"

// Attribute keys. Metrics carry perspective and reason, never the stream ID, so their
// cardinality stays bounded; spans carry the stream too.
const (
	attrPerspective  = attribute.Key("perspective")
	attrVersion      = attribute.Key("version")
	attrState        = attribute.Key("state")
	attrReason       = attribute.Key("reason")
	attrStream       = attribute.Key("stream")
	attrFromSnapshot = attribute.Key("from_snapshot")
	attrStage        = attribute.Key("stage")
	attrResult       = attribute.Key("result")
)

// telemetry holds the worker's instruments.
type telemetry struct {
	tracer trace.Tracer
	meter  metric.Meter

	lockAcquired      metric.Int64Counter
	lockContended     metric.Int64Counter
	lockLost          metric.Int64Counter
	lockRenewFailures metric.Int64Counter
	lockReleased      metric.Int64Counter
	lockTakeovers     metric.Int64Counter
	lockHold          metric.Float64Histogram

	rewindStarted   metric.Int64Counter
	rewindCompleted metric.Int64Counter
	rewindFailed    metric.Int64Counter
	rewindDuration  metric.Float64Histogram
	rewindReplayed  metric.Int64Counter

	bootstraps    metric.Int64Counter
	purges        metric.Int64Counter
	eventsApplied metric.Int64Counter
	applyErrors   metric.Int64Counter
	catchUpEvents metric.Int64Counter
	sinkDuration  metric.Float64Histogram
	sinkFailures  metric.Int64Counter

	queueDepth     metric.Int64ObservableGauge
	queueOldest    metric.Float64ObservableGauge
	catchUpRead    metric.Int64ObservableGauge
	catchUpStreams metric.Int64ObservableGauge
	catchUpDone    metric.Int64ObservableGauge
	pairsFailing   metric.Int64ObservableGauge
	pairsParked    metric.Int64ObservableGauge
	instancesLive  metric.Int64ObservableGauge
}

func newTelemetry(mp metric.MeterProvider, tp trace.TracerProvider) (*telemetry, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	t := &telemetry{tracer: tp.Tracer(instrumentationName), meter: mp.Meter(instrumentationName)}
	m := t.meter
	var errs []error
	counter := func(dst *metric.Int64Counter, name, unit, desc string) {
		c, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		*dst = c
	}
	histogram := func(dst *metric.Float64Histogram, name, desc string) {
		h, err := m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc))
		errs = append(errs, err)
		*dst = h
	}
	counter(&t.lockAcquired, "perspectives.lock.acquired", "{lock}", "Stream locks acquired, by reason and perspective.")
	counter(&t.lockContended, "perspectives.lock.contended", "{attempt}", "Acquire attempts refused because another instance holds the lock.")
	counter(&t.lockLost, "perspectives.lock.lost", "{lock}", "Locks found lost while held: by a renewal (stage=renew), by the lease's local deadline (stage=deadline) or by the fencing check at commit (stage=commit).")
	counter(&t.lockRenewFailures, "perspectives.lock.renew_failures", "{renewal}", "Renewals that failed with an error (retried at the next tick).")
	counter(&t.lockReleased, "perspectives.lock.released", "{lock}", "Stream locks released.")
	counter(&t.lockTakeovers, "perspectives.lock.takeovers", "{lock}", "Locks acquired by replacing another instance's expired lock.")
	histogram(&t.lockHold, "perspectives.lock.hold_duration", "Time from acquiring a stream lock to releasing it.")
	counter(&t.rewindStarted, "perspectives.rewind.started", "{rewind}", "Rewinds started (lock acquired, or no locker).")
	counter(&t.rewindCompleted, "perspectives.rewind.completed", "{rewind}", "Rewinds committed, by whether they restored a snapshot (from_snapshot).")
	counter(&t.rewindFailed, "perspectives.rewind.failed", "{rewind}", "Rewinds that failed or were refused at commit.")
	histogram(&t.rewindDuration, "perspectives.rewind.duration", "Duration of committed rewinds, by from_snapshot.")
	counter(&t.rewindReplayed, "perspectives.rewind.events_replayed", "{event}", "Events replayed by committed rewinds, by from_snapshot.")
	counter(&t.bootstraps, "perspectives.bootstrap.count", "{bootstrap}", "Snapshot bootstraps, by result (ok, error) and whether the lock was held (locked).")
	counter(&t.purges, "perspectives.purge.count", "{purge}", "Purges, by result (ok, locked, error).")
	counter(&t.eventsApplied, "perspectives.events.applied", "{event}", "Events applied by the normal path and by catch-ups.")
	counter(&t.applyErrors, "perspectives.apply.errors", "{error}", "Apply failures (error or panic in a perspective, or a failed rewind).")
	counter(&t.catchUpEvents, "perspectives.catchup.events_read", "{event}", "Stored events read by this instance's catch-ups, by perspective and version.")
	histogram(&t.sinkDuration, "perspectives.sink.duration", "Time of a Sink's Write per committing transaction, by perspective and version.")
	counter(&t.sinkFailures, "perspectives.sink.failures", "{error}", "Sink Writes that failed (their transaction rolled back), by perspective and version.")
	gauge := func(dst *metric.Int64ObservableGauge, name, unit, desc string) {
		g, err := m.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		*dst = g
	}
	gauge(&t.queueDepth, "perspectives.queue.depth", "{event}", "Events queued per perspective and version (state: building or active).")
	var err error
	t.queueOldest, err = m.Float64ObservableGauge("perspectives.queue.oldest_age", metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest queued event per perspective and version (database clock): the lag."))
	errs = append(errs, err)
	gauge(&t.catchUpRead, "perspectives.catchup.events", "{event}", "Stored events a build's catch-up has read, per perspective and version.")
	gauge(&t.catchUpStreams, "perspectives.catchup.streams", "{stream}", "Streams a build's catch-up has passed, per perspective and version.")
	gauge(&t.catchUpDone, "perspectives.catchup.done", "1", "1 when a build has caught up with the store, else 0, per perspective and version.")
	gauge(&t.pairsFailing, "perspectives.pairs.failing", "{pair}", "(stream, perspective) pairs whose last attempt failed and that are retried with backoff, per perspective and version.")
	gauge(&t.pairsParked, "perspectives.pairs.parked", "{pair}", "(stream, perspective) pairs parked after repeated failures, waiting for an operator, per perspective and version.")
	gauge(&t.instancesLive, "perspectives.instances.live", "{instance}", "Worker instances alive (heartbeats, database clock) that run the perspective's version.")
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("worker: telemetry: %w", err)
	}
	return t, nil
}

// observeBuilds registers the gauges of the builds (not retired) of the perspectives
// names, read from store at collection time.
func (t *telemetry) observeBuilds(store Store, names []string) (metric.Registration, error) {
	return t.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		rows, err := store.Status(ctx)
		if err != nil {
			return err
		}
		for _, r := range rows {
			if r.State == BuildRetired || !slices.Contains(names, r.Perspective) {
				continue
			}
			set := metric.WithAttributes(attrPerspective.String(r.Perspective), attrVersion.Int(r.Version), attrState.String(r.State))
			o.ObserveInt64(t.queueDepth, r.Queued, set)
			o.ObserveFloat64(t.queueOldest, r.OldestQueued.Seconds(), set)
			o.ObserveInt64(t.catchUpRead, r.CatchUpEvents, set)
			o.ObserveInt64(t.catchUpStreams, r.CatchUpStreams, set)
			done := int64(0)
			if r.CatchUpDone {
				done = 1
			}
			o.ObserveInt64(t.catchUpDone, done, set)
			o.ObserveInt64(t.pairsFailing, r.Failing, set)
			o.ObserveInt64(t.pairsParked, r.Parked, set)
			o.ObserveInt64(t.instancesLive, r.LiveInstances, set)
		}
		return nil
	}, t.queueDepth, t.queueOldest, t.catchUpRead, t.catchUpStreams, t.catchUpDone, t.pairsFailing, t.pairsParked, t.instancesLive)
}

// startSpan starts a span for a long operation on k.
func (w *Worker) startSpan(ctx context.Context, name string, k Pair) (context.Context, trace.Span) {
	b := w.buildOf(k.Perspective)
	return w.tel.tracer.Start(ctx, name, trace.WithAttributes(
		attrPerspective.String(b.Perspective), attrVersion.Int(b.Version), attrStream.String(k.Stream.String()),
		attribute.String("instance", w.cfg.InstanceID.String())))
}

// endSpan records err on span and ends it.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
