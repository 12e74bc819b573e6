// Package worker folds stored events into read models ("perspectives") on PostgreSQL, on any
// number of instances sharing one database, which is their only coordinator.
//
// An application appends events to streams; every perspective folds each stream's events, in
// event-ID order, into one JSON model per stream, kept beside the events. Appending an event
// queues it for every registered perspective in the same statement, and running workers apply
// the queue: live application, many pairs (a stream and a perspective build) per
// transaction. An event that arrives late, older than what a pair has applied, makes the
// worker rewind that pair under a stream lock, from the newest snapshot before it, and commit
// under a fencing check; the pair's new events keep queueing meanwhile. A new perspective,
// or a new version of one, is caught up from the event store in the background and served
// once it has caught up. A perspective that keeps failing on one event stops only its pair,
// which its failure policy parks or moves past. The terms are those of the glossary in the
// repository's docs/concepts.md.
//
// # Writing and reading
//
// [Append] stores events and queues them, atomically; given a pgx.Tx, it runs inside the
// application's own transaction and queues nothing unless that transaction commits. A zero
// [Event.ID] gets a UUIDv7. [LoadModel] returns a stream's model in the active version of a
// perspective as JSON, [Load] decodes it into a Go type. Workers apply events after their
// commit, so a reader that must see its own write waits for it: [WaitFor] returns once the event is in the model LoadModel serves, or
// with an error wrapping [ErrParked] (the pair is parked before the event) or [ErrSkipped]
// (the event was skipped).
//
// Functions that read a model name the perspective first ([LoadModel], [Load], [WaitFor]:
// perspective, then stream, as one reads "the orders model of stream S"); operations on a
// pair name the stream first ([Worker.Purge] and the [Admin] methods that take both, like
// the locker's methods: stream, then perspective).
//
// # Perspectives
//
// A [Perspective] has a Name and an Apply that returns the model after an event;
// [JSONPerspective] builds one over a Go type. A Perspective that also implements
// [Versioned] (a Version() int method) is that version of its name; without it, it is
// version 1. A newly seen version builds beside the active one, from the event store, and
// replaces it for every stream at once when it has caught up; readers get the old version's
// complete models until then.
//
// # Read models in the application's tables
//
// The JSON model is the source of truth. A perspective that also implements [Sink] writes
// its models to the application's own tables too, in the transaction that commits them:
// Write(ctx, tx, changes) is called once per committing transaction with every pair whose
// model changed there (a [Change]: the stream, its [Build], the model, nil when purged, and
// whether it is a Replay), on every path that changes a model (live application, rewinds,
// catch-ups, rebuilds, purges). Run the application's sqlc queries on tx. An error rolls
// the transaction back and fails the pair like an Apply error (retried, then parked). A
// building version writes beside the active one (each change names its build: write a
// build column, or a table per build); a [Promoter] repoints the readers in the promotion
// transaction (a view, say), so they switch with LoadModel; a [Retirer] deletes a retired
// build's rows. The repository's examples/orders is a complete application.
//
// # Running workers
//
// [New] validates a [Config] and returns a [Worker]; [Worker.Start] registers its
// perspectives and returns at once, the work going on in the background; [Worker.Stop] ends
// it gracefully. [Config.Locker] (a [locker.Postgres]) gives stream locks across instances,
// needed when more than one instance runs. Idle workers are woken by each committed Append
// through LISTEN/NOTIFY and otherwise poll every [Config.PollInterval]; behind a transaction
// pooler, [Config.ListenConnect] gives them a direct session to LISTEN on. The zero value of
// every Config field is its default.
//
// # Failures
//
// An error or panic in Apply fails only its pair: the events before the failing one are
// committed, the pair is retried with backoff ([Config.RetryBackoff]), and after
// [FailurePolicy.Attempts] failures in a row its [FailurePolicy] ([Config.FailurePolicy],
// per perspective [Config.FailurePolicies]) parks the pair until an operator acts, or skips
// the event and records the skip. [Admin] is what operators act with, without running any
// perspective: [Admin.Failed] lists failing and parked pairs, [Admin.Retry] retries them,
// [Admin.Skip] skips an event, [Admin.Skipped] lists the skips. It also purges or rebuilds
// a stream ([Admin.Purge], [Admin.Rebuild]), rebuilds or promotes a perspective
// ([Admin.RebuildPerspective], [Admin.Promote]) and reports builds and instances
// ([Admin.Versions], [Admin.Instances]). The command-line tool's operator commands and the
// dashboard (package ui) call these methods.
//
// # Observability
//
// Metrics go through the OpenTelemetry metric API to [Config.MeterProvider], spans around
// rewinds, bootstraps and purges to [Config.TracerProvider]; both are no-ops unless the
// application installs a provider. Among them: perspectives.queue.oldest_age (a build's
// lag), perspectives.pairs.parked and perspectives.pairs.failing. The full list, the logs
// and the alert rules are in the repository's docs/operations.md. Logs go to
// [Config.Logger].
//
// [Store] and the types of its methods (ClaimRequest, CatchUpPage, PairWrite, …) are the
// worker's seam to the database, for its own tests; an application needs none of them.
package worker
