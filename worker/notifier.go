package worker

// The notifier: one LISTEN session per process and pool, shared by the worker's loop and
// every WaitFor.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/db"
	"github.com/perspectives-go/perspectives/internal/pgq"
)

// The topics a notifier subscribes to: PostgreSQL notification channels.
const (
	topicQueue   = "wh_perspective_events" // pairs were made due (wh_append queued rows, an operator retried)
	topicApplied = "wh_applied"            // a commit made events visible in models (WaitFor)
	topicProbe   = "wh_notifier_probe"     // the notifier's own probe
)

// topicStatements are the statements that subscribe a session to a topic and end the
// subscription.
var topicStatements = map[string]struct {
	listen, unlisten func(*db.Queries, context.Context) error
}{
	topicQueue:   {(*db.Queries).NotifierListenQueue, (*db.Queries).NotifierUnlistenQueue},
	topicApplied: {(*db.Queries).NotifierListenApplied, (*db.Queries).NotifierUnlistenApplied},
}

// notifier is the LISTEN session of one pool in this process, shared by every subscriber
// on that pool: the worker's loop (topicQueue) and each WaitFor (topicApplied). Notifiers
// are keyed by the pool, not by the database it reaches: two pools on one database have
// a session each. A notifier starts with its first subscriber and stops when its last one
// leaves.
//
// Its session is never a pool connection: it is ListenConnect's connection when a started
// worker offers one (its Config.ListenConnect, see offerListenConnect), else a
// connection of its own opened with the pool's ConnConfig (the pool's BeforeConnect and
// AfterConnect hooks do not run for it). A waiting subscriber holds no pool connection.
//
// Opened with the pool's ConnConfig, a session that goes through a transaction pooler (its
// backend is not the one it was opened with, see pgq.Pooled) cannot receive notifications:
// the notifier then polls (its subscribers are told, and poll on their own) until a worker
// offers a ListenConnect. Once subscribed, the session sends itself a probe
// through the pool and waits up to probeTimeout for it. A session that fails (the probe
// does not arrive, the connection is lost) is opened again after a backoff (1 s doubling
// to 30 s); its subscribers are told it was lost, and told again once it is subscribed
// anew, so that they check for what they missed.
//
// One goroutine reads the session. It hands each notification to the subscribers of its
// topic without ever blocking: a subscription keeps what it was not yet given, and has a
// channel of one that says so (see subscription).
type notifier struct {
	pool *pgxpool.Pool
	svc  service

	mu        sync.Mutex
	connect   func(context.Context) (*pgx.Conn, error) // ListenConnect; nil: the pool's ConnConfig
	owner     any                                      // whose offer connect is
	subs      map[string]map[*subscription]bool        // per topic
	session   uint64                                   // the session subscribed now (0: none)
	listening map[string]bool                          // the topics the session is subscribed to
	polling   bool                                     // the pool goes through a pooler and no ListenConnect was given
	err       error                                    // why the last session was lost, while none serves (nil once one does)
	changed   bool                                     // topics or connect changed since the reader last looked
	interrupt context.CancelFunc                       // ends the reader's wait for a notification
	kick      chan struct{}                            // wakes the reader from polling
}

// notifiers holds the notifier of each pool that has subscribers, and the ListenConnects
// that started workers offer for their pool (offerListenConnect), earliest first.
var notifiers = struct {
	mu       sync.Mutex
	m        map[*pgxpool.Pool]*notifier
	connects map[*pgxpool.Pool][]offeredConnect
}{m: map[*pgxpool.Pool]*notifier{}, connects: map[*pgxpool.Pool][]offeredConnect{}}

// offeredConnect is a ListenConnect a worker offers for its pool, and whose it is.
type offeredConnect struct {
	connect func(context.Context) (*pgx.Conn, error)
	owner   any
}

// offeredFor is the ListenConnect a notifier of pool dials: the earliest offer that stands
// (zero: none). notifiers.mu is held.
func offeredFor(pool *pgxpool.Pool) offeredConnect {
	if offers := notifiers.connects[pool]; len(offers) > 0 {
		return offers[0]
	}
	return offeredConnect{}
}

// offerListenConnect offers connect as the session of pool's notifier, from now until
// withdrawn by owner; of the offers that stand, the earliest serves. It is the only way a
// notifier gets a ListenConnect: a started worker offers its Config.ListenConnect before its
// loop subscribes; a notifier dials the earliest offer standing, and one already running
// without any (a WaitFor subscribed first) takes the offer when it is made, and stops polling
// to try it. A withdrawn offer serves no later session (see withdrawListenConnect).
func offerListenConnect(pool *pgxpool.Pool, connect func(context.Context) (*pgx.Conn, error), owner any) {
	notifiers.mu.Lock()
	defer notifiers.mu.Unlock()
	if connect == nil {
		return
	}
	notifiers.connects[pool] = append(notifiers.connects[pool], offeredConnect{connect: connect, owner: owner})
	n := notifiers.m[pool]
	if n == nil {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.connect != nil {
		return
	}
	n.connect, n.owner = connect, owner
	if n.polling {
		n.polling = false // try again, with the direct session
		for _, subs := range n.subs {
			for t := range subs {
				t.update(func() { t.polling = false })
			}
		}
	}
	n.poke()
}

// withdrawListenConnect withdraws owner's offers for pool. A running notifier that dials
// owner's keeps its session, and dials the next offer standing (or the pool's ConnConfig)
// for the sessions after it.
func withdrawListenConnect(pool *pgxpool.Pool, owner any) {
	notifiers.mu.Lock()
	defer notifiers.mu.Unlock()
	offers := slices.DeleteFunc(notifiers.connects[pool], func(o offeredConnect) bool { return o.owner == owner })
	if len(offers) == 0 {
		delete(notifiers.connects, pool)
	} else {
		notifiers.connects[pool] = offers
	}
	if n := notifiers.m[pool]; n != nil {
		n.mu.Lock()
		if n.owner == owner {
			next := offeredFor(pool)
			n.connect, n.owner = next.connect, next.owner
		}
		n.mu.Unlock()
	}
}

// subscribe subscribes to topic on pool's notifier, starting the notifier when it has no
// other subscriber; its session is the earliest ListenConnect offered for pool that stands,
// if any (see offerListenConnect). Close the subscription when done.
func subscribe(pool *pgxpool.Pool, topic string) *subscription {
	notifiers.mu.Lock()
	defer notifiers.mu.Unlock()
	n := notifiers.m[pool]
	if n == nil {
		// connect is the notifier's before its goroutine starts, which reads it to dial.
		offer := offeredFor(pool)
		n = &notifier{pool: pool, connect: offer.connect, owner: offer.owner, subs: map[string]map[*subscription]bool{}, listening: map[string]bool{}, kick: make(chan struct{}, 1)}
		notifiers.m[pool] = n
		_ = n.svc.Start(context.Background()) // a fresh service: it starts
		n.svc.Go(n.run)
	}
	s := &subscription{n: n, topic: topic, c: make(chan struct{}, 1)}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.subs[topic] == nil {
		n.subs[topic] = map[*subscription]bool{}
	}
	n.subs[topic][s] = true
	switch {
	case n.polling:
		s.polling = true
		s.signal()
	case n.listening[topic]:
		s.session = n.session // already subscribed
		s.signal()
	default:
		if n.session == 0 && n.err != nil {
			s.err = n.err // the notifier waits to open a session: the subscriber is told why
			s.signal()
		}
		n.poke()
	}
	return s
}

// close ends s; the last subscription of a notifier stops it, and waits for its session to
// close (at most a subscribing statement's grace, probeTimeout, and the close's second). It
// is idempotent.
func (s *subscription) close() { s.closeOnce.Do(s.unsubscribe) }

func (s *subscription) unsubscribe() {
	n := s.n
	notifiers.mu.Lock()
	n.mu.Lock()
	delete(n.subs[s.topic], s)
	if len(n.subs[s.topic]) == 0 {
		delete(n.subs, s.topic)
		n.poke()
	}
	last := len(n.subs) == 0
	n.mu.Unlock()
	if last && notifiers.m[n.pool] == n {
		delete(notifiers.m, n.pool)
	}
	notifiers.mu.Unlock()
	if last {
		_ = n.svc.Stop(context.Background()) // bounded: see service and run
	}
}

// poke tells the reader that topics or connect changed. n.mu is held.
func (n *notifier) poke() {
	n.changed = true
	if n.interrupt != nil {
		n.interrupt()
	}
	select {
	case n.kick <- struct{}{}:
	default:
	}
}

// subscription is one subscriber's subscription to a topic. The notifier signals c (a
// channel of one: signals coalesce) whenever there is something to take: notifications
// received, or a change of the session. Take it with take; a subscriber that is slow to
// take never holds up the notifier nor the other subscribers.
type subscription struct {
	n         *notifier
	topic     string
	c         chan struct{}
	closeOnce sync.Once

	mu sync.Mutex
	notice
}

// notice is a subscription's state, and what it has to say when taken.
type notice struct {
	notified bool   // a notification was received since the last take
	session  uint64 // the session whose subscription to the topic is in effect (0: none, not yet or lost: see err)
	polling  bool   // the notifier cannot LISTEN: poll
	err      error  // why the last session was lost
}

// take returns, and forgets, whether a notification was received since the last take, with
// the subscription's state.
func (s *subscription) take() notice {
	s.mu.Lock()
	defer s.mu.Unlock()
	nt := s.notice
	s.notified = false
	return nt
}

// update changes s under its lock and signals it.
func (s *subscription) update(f func()) {
	s.mu.Lock()
	f()
	s.mu.Unlock()
	s.signal()
}

func (s *subscription) signal() {
	select {
	case s.c <- struct{}{}:
	default:
	}
}

// deliver tells the subscribers of topic that a notification came (no subscriber reads a
// payload).
func (n *notifier) deliver(topic string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for s := range n.subs[topic] {
		s.update(func() { s.notified = true })
	}
}

// notifierRetryMin and notifierRetryMax bound the backoff between two sessions.
const (
	notifierRetryMin = time.Second
	notifierRetryMax = 30 * time.Second
)

// run is the notifier's goroutine: a session, and another after a backoff when it fails,
// until stopping ends. The wait for a notification ends with stopping at once (an
// interrupted read, no cancel request); the statements are let finish (see runSession).
func (n *notifier) run(_, stopping context.Context) {
	retry := backoff{first: notifierRetryMin, max: notifierRetryMax}
	for {
		started := time.Now()
		err := n.runSession(stopping)
		if stopping.Err() != nil {
			n.lost(err)
			return
		}
		if errors.Is(err, ErrNotificationsLost) && n.setPolling() {
			if !n.waitForOffer(stopping) {
				return
			}
			continue
		}
		n.lost(err)
		if time.Since(started) > time.Minute {
			retry.reset() // it had been working: not a persistent failure
		}
		t := time.NewTimer(retry.fail(time.Now()))
		select {
		case <-stopping.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// waitForOffer waits, while the notifier polls, until a worker offers a ListenConnect (true)
// or stopping ends (false). Other pokes (a topic's last subscriber left) do not end it.
func (n *notifier) waitForOffer(stopping context.Context) bool {
	for {
		select {
		case <-stopping.Done():
			return false
		case <-n.kick:
		}
		n.mu.Lock()
		offered := n.connect != nil
		n.mu.Unlock()
		if offered {
			return true
		}
	}
}

// setPolling tells every subscriber that the notifier cannot LISTEN, and reports true;
// false when a worker offered a ListenConnect meanwhile (try it).
func (n *notifier) setPolling() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.connect != nil {
		return false
	}
	n.polling = true
	select { // a kick from before: no ListenConnect came with it
	case <-n.kick:
	default:
	}
	for _, subs := range n.subs {
		for s := range subs {
			s.update(func() { s.polling, s.session = true, 0 })
		}
	}
	return true
}

// lost tells every subscriber that the session is gone, with why.
func (n *notifier) lost(err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.session, n.err = 0, err
	clear(n.listening)
	for _, subs := range n.subs {
		for s := range subs {
			s.update(func() { s.session, s.err = 0, err })
		}
	}
}

// sessions counts the sessions ever subscribed, for their numbers.
var sessions atomic.Uint64

// runSession opens a session, subscribes it and reads it until live ends or it fails.
// Its statements (the pooler check, each LISTEN and UNLISTEN, the probe) are let finish
// up to probeTimeout after live ends: pgx cancels a statement by sending the server a
// cancel request, which PgBouncer before 1.21 can exit on, and closes its connection.
func (n *notifier) runSession(live context.Context) error {
	sctx, cancelStatements := graceAfter(live, probeTimeout)
	defer cancelStatements()
	n.mu.Lock()
	connect := n.connect
	n.mu.Unlock()
	conn, err := n.dial(sctx, connect)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		// The session is gone either way; Close's only error is the socket's, and the
		// subscribers learn of the loss from the session's end.
		_ = conn.Close(cctx)
	}()
	if connect == nil {
		if pooled, _, _, err := pgq.Pooled(sctx, conn); err != nil || pooled {
			return cmp.Or(err, ErrNotificationsLost)
		}
	}
	q := pgq.New(conn)
	if err := q.NotifierListenProbe(sctx); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	id := sessions.Add(1)
	probe := uuid.NewString()
	probed := false
	deadline := time.Time{}
	for {
		if live.Err() != nil {
			return live.Err()
		}
		if err := n.subscribeTopics(sctx, q, id); err != nil {
			return err
		}
		if !probed {
			if err := pgq.New(n.pool).NotifierProbe(sctx, probe); err != nil {
				return fmt.Errorf("send a probe notification: %w", err)
			}
			probed, deadline = true, time.Now().Add(probeTimeout)
		}
		wctx, cancel := context.WithCancel(live)
		if !deadline.IsZero() {
			cancel()
			wctx, cancel = context.WithDeadline(live, deadline)
		}
		n.mu.Lock()
		n.interrupt = cancel
		if n.changed {
			cancel()
		}
		n.mu.Unlock()
		msg, err := conn.WaitForNotification(wctx)
		n.mu.Lock()
		n.interrupt = nil
		n.mu.Unlock()
		interrupted := wctx.Err() != nil
		cancel()
		switch {
		case err == nil:
			if msg.Channel == topicProbe {
				if msg.Payload == probe {
					deadline = time.Time{}
				}
				continue
			}
			n.deliver(msg.Channel)
		case live.Err() != nil:
			return live.Err()
		case !interrupted:
			return fmt.Errorf("wait for a notification: %w", err)
		case !deadline.IsZero() && !time.Now().Before(deadline):
			return fmt.Errorf("the subscription's probe notification did not arrive within %s", probeTimeout)
		}
		// Interrupted: the topics changed.
	}
}

// dial opens the session: connect's connection, else one with the pool's ConnConfig.
func (n *notifier) dial(ctx context.Context, connect func(context.Context) (*pgx.Conn, error)) (*pgx.Conn, error) {
	if connect == nil {
		return pgx.ConnectConfig(ctx, n.pool.Config().ConnConfig)
	}
	conn, err := connect(ctx)
	if err == nil && conn == nil {
		err = errors.New("returned no connection")
	}
	if err != nil {
		return nil, fmt.Errorf("ListenConnect: %w", err)
	}
	return conn, nil
}

// subscribeTopics makes the session's subscriptions those of the subscribers, and tells
// the subscribers of each topic subscribed that session id serves them.
func (n *notifier) subscribeTopics(ctx context.Context, q *db.Queries, id uint64) error {
	for {
		n.mu.Lock()
		n.changed = false
		var add, drop []string
		for topic := range n.subs {
			if !n.listening[topic] {
				add = append(add, topic)
			}
		}
		for topic := range n.listening {
			if n.subs[topic] == nil {
				drop = append(drop, topic)
			}
		}
		// A dropped topic is not listened to from now: a subscriber that comes while its
		// UNLISTEN runs is served by the LISTEN of the next round, and told so then.
		for _, topic := range drop {
			delete(n.listening, topic)
		}
		n.mu.Unlock()
		if len(add) == 0 && len(drop) == 0 {
			break
		}
		for _, topic := range add {
			if err := topicStatements[topic].listen(q, ctx); err != nil {
				return fmt.Errorf("listen on %s: %w", topic, err)
			}
		}
		for _, topic := range drop {
			if err := topicStatements[topic].unlisten(q, ctx); err != nil {
				return fmt.Errorf("unlisten %s: %w", topic, err)
			}
		}
		n.mu.Lock()
		for _, topic := range add {
			n.listening[topic] = true
		}
		n.mu.Unlock()
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.session, n.err = id, nil
	for topic := range n.listening {
		for s := range n.subs[topic] {
			if s.session != id {
				s.update(func() { s.session = id })
			}
		}
	}
	return nil
}

// Listen subscribes to the queue's notification on the pool's notifier (see notifier),
// which the process's WaitFor calls share: its session is the ListenConnect offered for the
// pool (startBackground offers the store's), else a connection of its own (never a pool
// connection). Behind a transaction pooler without a ListenConnect, Listen returns
// ErrNotificationsLost.
func (s *pgStore) Listen(ctx context.Context, notify func(), state func(error)) error {
	sub := subscribe(s.pool, topicQueue)
	defer sub.close()
	var session uint64
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-sub.c:
		}
		nt := sub.take()
		switch {
		case nt.polling:
			return ErrNotificationsLost
		case nt.session == 0 && nt.err != nil:
			session = 0
			state(nt.err)
		case nt.session != 0 && nt.session != session:
			session = nt.session
			state(nil)
		}
		if nt.notified {
			notify()
		}
	}
}

// probeTimeout bounds the wait for the notifier's probe notification, and the grace of its
// subscribing statements.
const probeTimeout = 2 * time.Second

// graceAfter returns a context that ends grace after ctx ends (or when cancel is called),
// for statements that should finish rather than be cancelled when ctx ends.
func graceAfter(ctx context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	gctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() {
		select {
		case <-gctx.Done():
		case <-time.After(grace):
			cancel()
		}
	})
	return gctx, func() { stop(); cancel() }
}

// ErrNotificationsLost is returned by Store.Listen when its connection cannot receive the
// notifications it would subscribe to: it goes through a pooler (see Config.ListenConnect).
var ErrNotificationsLost = errors.New("LISTEN receives no notifications on this connection")

// NotificationStore is how the loop hears of due pairs.
type NotificationStore interface {
	// Listen subscribes to the queue's notification (which every committed Append that
	// queued rows sends, and every other statement that makes pairs due) until ctx ends. It
	// calls state(nil) each time the subscription takes effect (events may have been
	// appended before it did); state with why when it is lost or cannot be opened (a
	// restart, a failover), possibly again until a session serves it, and it subscribes
	// again on its own; and notify for each notification. It returns ctx's error, or
	// ErrNotificationsLost when the connection cannot receive notifications at all (it goes
	// through a pooler): the worker then polls only, and says so once.
	Listen(ctx context.Context, notify func(), state func(err error)) error
}
