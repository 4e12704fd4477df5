// Package notify sends route changes, runtime events and turn outcomes to the
// session service (SessionNotifyService). Each session's notifications go
// out in the order they were raised, on their own lane: a notification that
// keeps failing holds only its session's lane, never another session's. A
// failure is retried with backoff on the lane (the worker moves on to other
// lanes meanwhile) while the session service is unavailable, up to giveUp;
// Internal and Unknown are retried a few times only. Every call is
// idempotent on the receiver. The queue is bounded: see enqueue. Without a
// session address the notifier only logs.
package notify

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/edge/wrapperconn"
)

func refProto(r driver.RouteRef) *sessionv1.RouteRef {
	return &sessionv1.RouteRef{SessionId: r.SessionID, SandboxId: r.SandboxID, AllocationId: r.AllocationID,
		FenceToken: r.FenceToken, ObserveTime: timestamppb.Now()}
}

// Bounds of the queue (see enqueue).
const (
	// MaxLaneItems is how many notifications one session may have queued.
	MaxLaneItems = 1000
	// MaxQueued is how many all sessions together may have queued.
	MaxQueued = 20000
	// MaxBatchEvents bounds the events merged into one queued batch.
	MaxBatchEvents = 1000
	// workers send on that many lanes at once.
	workers = 4
	// internalAttempts: Internal and Unknown say the receiver failed on
	// this very input; a few tries cover a transient fault, more would not.
	internalAttempts = 3
)

type job struct {
	kind   string
	ref    driver.RouteRef
	events []driver.RuntimeEvent // kind "events": merged with the next batches while queued
	call   func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error
}

func (j job) send(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
	if j.kind == "events" {
		_, err := c.NotifyRuntimeEvents(ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: refProto(j.ref), Events: wrapperconn.EventsProto(j.events)})
		return err
	}
	return j.call(ctx, c)
}

// droppable: progress and events are a stream the session service can
// miss (the turn outcome and the route states are what it acts on); they
// are what the bound drops.
func (j job) droppable() bool { return j.kind == "events" || j.kind == "progress" }

// lane is one session's notifications, in the order raised.
type lane struct {
	jobs     []job
	busy     bool      // a worker is sending jobs[0]
	retryAt  time.Time // jobs[0] failed: not before then
	backoff  time.Duration
	since    time.Time // first attempt of jobs[0]
	attempts int       // of jobs[0]
}

// Notifier queues notifications on per-session lanes for a few workers; it
// is the driver's driver.Notifier.
type Notifier struct {
	client  sessionv1.SessionNotifyServiceClient // nil: log only
	log     *slog.Logger
	giveUp  time.Duration
	mu      sync.Mutex
	lanes   map[string]*lane
	order   []string // sessions with a lane, oldest first
	queued  int
	dropped atomic.Uint64
	wake    chan struct{}
	pending sync.WaitGroup
}

var _ driver.Notifier = (*Notifier)(nil)

// New builds a notifier; client may be nil. A notification still failing
// after giveUp is dropped (the session service's backstops take over).
func New(client sessionv1.SessionNotifyServiceClient, log *slog.Logger, giveUp time.Duration) *Notifier {
	if giveUp <= 0 {
		giveUp = 5 * time.Minute
	}
	return &Notifier{client: client, log: log, giveUp: giveUp, lanes: map[string]*lane{}, wake: make(chan struct{}, 1)}
}

// Depth is how many notifications are queued (the metric
// sandbox_notification_queue_depth).
func (n *Notifier) Depth() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.queued
}

// Dropped is how many notifications were dropped: by the bound, as not
// retryable, or still failing after giveUp (sandbox_notifications_dropped_total).
func (n *Notifier) Dropped() uint64 { return n.dropped.Load() }

// Run sends queued notifications until ctx ends. A notification whose
// sending ctx cut short stays queued, first on its lane, for Drain.
func (n *Notifier) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				session, j, ok := n.take(ctx)
				if !ok {
					return
				}
				n.attempt(ctx, session, j)
			}
		})
	}
	wg.Wait()
}

// take marks the first lane whose head may be sent now busy and returns
// that head; it waits for one until ctx ends. Once ctx has ended it takes
// none: a send cut short by ctx leaves its lane ready at once (no backoff),
// and taking it again would fail it again, forever.
func (n *Notifier) take(ctx context.Context) (string, job, bool) {
	for {
		if ctx.Err() != nil {
			return "", job{}, false
		}
		n.mu.Lock()
		now := time.Now()
		var next time.Time
		for _, s := range n.order {
			l := n.lanes[s]
			if l.busy {
				continue
			}
			if l.retryAt.After(now) {
				if next.IsZero() || l.retryAt.Before(next) {
					next = l.retryAt
				}
				continue
			}
			l.busy = true
			// Round robin: the lane goes last, so a session with a long
			// queue takes turns with the others.
			n.order = append(slices.DeleteFunc(n.order, func(x string) bool { return x == s }), s)
			j := l.jobs[0]
			n.mu.Unlock()
			return s, j, true
		}
		n.mu.Unlock()
		var timer <-chan time.Time
		t := time.NewTimer(time.Until(next))
		if !next.IsZero() {
			timer = t.C
		}
		select {
		case <-ctx.Done():
			t.Stop()
			return "", job{}, false
		case <-n.wake:
		case <-timer:
		}
		t.Stop()
	}
}

// attempt sends a lane's head once: delivered or dropped, it leaves the
// lane; a retryable failure sets when the lane may try again.
func (n *Notifier) attempt(ctx context.Context, session string, j job) {
	n.log.Debug("route notification", "kind", j.kind, "session", j.ref.SessionID, "sandbox", j.ref.SandboxID)
	var err error
	if n.client != nil {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err = j.send(cctx, n.client)
		cancel()
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	l := n.lanes[session]
	l.busy = false
	defer n.signal()
	if err != nil && ctx.Err() != nil {
		return // stays first for Drain
	}
	if l.attempts == 0 {
		l.since = time.Now()
	}
	l.attempts++
	if err != nil && retryable(err, l.attempts) && time.Since(l.since) < n.giveUp {
		l.backoff = min(max(2*l.backoff, 100*time.Millisecond), 5*time.Second)
		l.retryAt = time.Now().Add(l.backoff)
		return
	}
	if err != nil {
		n.dropped.Add(1)
		n.log.Warn("notification dropped", "kind", j.kind, "session", j.ref.SessionID, "code", status.Code(err).String(), "attempts", l.attempts)
	}
	n.popLocked(session, l)
}

// popLocked removes the lane's head, and the lane once empty.
func (n *Notifier) popLocked(session string, l *lane) {
	l.jobs = l.jobs[1:]
	l.attempts, l.backoff, l.retryAt = 0, 0, time.Time{}
	n.queued--
	if len(l.jobs) == 0 {
		delete(n.lanes, session)
		n.order = slices.DeleteFunc(n.order, func(x string) bool { return x == session })
	}
	n.pending.Done()
}

func (n *Notifier) signal() {
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// Drain sends what is still queued once Run has returned and the driver
// raised its last notification (a graceful shutdown), each session's in
// order, until the queue is empty or ctx ends. It returns how many it left
// unsent; each is logged. Without it a rolling restart would lose the turn
// outcomes still queued, and their messages would wait for the session's
// no_outcome backstop.
func (n *Notifier) Drain(ctx context.Context) (unsent int) {
	for {
		n.mu.Lock()
		if len(n.order) == 0 {
			n.mu.Unlock()
			return unsent
		}
		session := n.order[0]
		l := n.lanes[session]
		j := l.jobs[0]
		n.mu.Unlock()
		if ctx.Err() != nil || !n.sendRetrying(ctx, j) {
			n.log.Warn("notification not sent at shutdown", "kind", j.kind, "session", j.ref.SessionID)
			unsent++
		}
		n.mu.Lock()
		n.popLocked(session, l)
		n.mu.Unlock()
	}
}

// sendRetrying delivers j, retrying as Run would, and reports whether j is
// done with (delivered or dropped); false when ctx ended first.
func (n *Notifier) sendRetrying(ctx context.Context, j job) bool {
	n.log.Debug("route notification", "kind", j.kind, "session", j.ref.SessionID, "sandbox", j.ref.SandboxID)
	if n.client == nil {
		return true
	}
	deadline := time.Now().Add(n.giveUp)
	backoff := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := j.send(cctx, n.client)
		cancel()
		switch {
		case err == nil:
			return true
		case ctx.Err() != nil:
			return false
		case !retryable(err, attempt) || time.Now().After(deadline):
			n.dropped.Add(1)
			n.log.Warn("notification dropped", "kind", j.kind, "session", j.ref.SessionID, "code", status.Code(err).String())
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 5*time.Second)
	}
}

// retryable: the session service is unavailable or busy; Internal and
// Unknown only for their first attempts.
func retryable(err error, attempts int) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted:
		return true
	case codes.Internal, codes.Unknown:
		return attempts < internalAttempts
	}
	return false
}

// enqueue puts j last on its session's lane. An events batch merges into
// the lane's last one when that is not being sent (same route, up to
// MaxBatchEvents events), so a burst of small batches takes a few items.
// The bound: when the lane holds MaxLaneItems or the queue MaxQueued, a
// progress or events notification is dropped (counted, logged); a route
// state or turn outcome is always queued (a few per session at most).
func (n *Notifier) enqueue(j job) {
	n.mu.Lock()
	defer n.mu.Unlock()
	s := j.ref.SessionID
	l := n.lanes[s]
	if l != nil && j.kind == "events" {
		if last := &l.jobs[len(l.jobs)-1]; last.kind == "events" && last.ref == j.ref &&
			!(l.busy && len(l.jobs) == 1) && len(last.events)+len(j.events) <= MaxBatchEvents {
			last.events = append(last.events, j.events...)
			return
		}
	}
	if j.droppable() && (l != nil && len(l.jobs) >= MaxLaneItems || n.queued >= MaxQueued) {
		if n.dropped.Add(1)%1000 == 1 {
			n.log.Warn("notification queue full: dropping progress and events", "kind", j.kind, "session", s, "queued", n.queued, "dropped", n.dropped.Load())
		}
		return
	}
	if l == nil {
		l = &lane{}
		n.lanes[s] = l
		n.order = append(n.order, s)
	}
	l.jobs = append(l.jobs, j)
	n.queued++
	n.pending.Add(1)
	n.signal()
}

// Flush waits until every queued notification was sent, dropped or left
// unsent by Drain (tests).
func (n *Notifier) Flush() { n.pending.Wait() }

// Progress reports a preparation step.
func (n *Notifier) Progress(ref driver.RouteRef, step driver.ProgressStep) {
	pb := wrapperconn.ProgressProto(step)
	n.enqueue(job{kind: "progress", ref: ref, call: func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteProgress(ctx, &sessionv1.NotifyRouteProgressRequest{Route: refProto(ref), Progress: pb})
		return err
	}})
}

// Ready reports a ready route served by wrapper instance.
func (n *Notifier) Ready(ref driver.RouteRef, runtimeSessionID, instance string) {
	n.enqueue(job{kind: "ready", ref: ref, call: func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteReady(ctx, &sessionv1.NotifyRouteReadyRequest{Route: refProto(ref), RuntimeSessionId: runtimeSessionID, WrapperInstance: instance})
		return err
	}})
}

// Reconnecting reports a dropped control stream.
func (n *Notifier) Reconnecting(ref driver.RouteRef) {
	n.enqueue(job{kind: "reconnecting", ref: ref, call: func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteReconnecting(ctx, &sessionv1.NotifyRouteReconnectingRequest{Route: refProto(ref)})
		return err
	}})
}

// Failed reports a failed preparation.
func (n *Notifier) Failed(ref driver.RouteRef, reason string, retry bool) {
	n.enqueue(job{kind: "failed", ref: ref, call: func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteFailed(ctx, &sessionv1.NotifyRouteFailedRequest{Route: refProto(ref), Reason: reason, Retryable: retry})
		return err
	}})
}

// Lost reports a route whose wrapper is gone.
func (n *Notifier) Lost(ref driver.RouteRef, reason string) {
	n.enqueue(job{kind: "lost", ref: ref, call: func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteLost(ctx, &sessionv1.NotifyRouteLostRequest{Route: refProto(ref), Reason: reason})
		return err
	}})
}

// Events forwards runtime events.
func (n *Notifier) Events(ref driver.RouteRef, evs []driver.RuntimeEvent) {
	n.enqueue(job{kind: "events", ref: ref, events: slices.Clone(evs)})
}

// Outcome forwards a turn outcome.
func (n *Notifier) Outcome(ref driver.RouteRef, outcome driver.TurnOutcome) {
	o := wrapperconn.OutcomeProto(outcome)
	n.enqueue(job{kind: "outcome", ref: ref, call: func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyTurnOutcome(ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: refProto(ref), Outcome: o})
		return err
	}})
}
