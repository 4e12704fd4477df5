// Package notify sends route changes, runtime events and turn outcomes to the
// session service (SessionNotifyService). Notifications go out in the order
// they were raised, one at a time, each retried with backoff while the
// session service is unavailable; every call is idempotent on the receiver.
// Without a session address the notifier only logs.
package notify

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/sandbox/internal/driver"
	"agentplane.dev/services/sandbox/internal/wrapperconn"
)

func refProto(r driver.RouteRef) *sessionv1.RouteRef {
	return &sessionv1.RouteRef{SessionId: r.SessionID, SandboxId: r.SandboxID, AllocationId: r.AllocationID,
		FenceToken: r.FenceToken, ObserveTime: timestamppb.Now()}
}

type job struct {
	kind string
	ref  driver.RouteRef
	call func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error
}

// Notifier queues notifications for one worker; it is the driver's
// driver.Notifier.
type Notifier struct {
	client  sessionv1.SessionNotifyServiceClient // nil: log only
	log     *slog.Logger
	giveUp  time.Duration
	mu      sync.Mutex
	queue   []job
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
	return &Notifier{client: client, log: log, giveUp: giveUp, wake: make(chan struct{}, 1)}
}

// Run sends queued notifications until ctx ends. A notification whose
// sending ctx cut short stays queued, first, for Drain.
func (n *Notifier) Run(ctx context.Context) {
	for {
		j, ok := n.next(ctx, true)
		if !ok {
			return
		}
		if !n.send(ctx, j) {
			n.requeue(j)
			return
		}
		n.pending.Done()
	}
}

// Drain sends, in order, what is still queued once Run has returned and
// the driver raised its last notification (a graceful shutdown), until the
// queue is empty or ctx ends. It returns how many it left unsent; each is
// logged. Without it a rolling restart would lose the turn outcomes still
// queued, and their messages would wait for the session's no_outcome
// backstop.
func (n *Notifier) Drain(ctx context.Context) (unsent int) {
	for {
		j, ok := n.next(ctx, false)
		if !ok {
			return unsent
		}
		if ctx.Err() != nil || !n.send(ctx, j) {
			n.log.Warn("notification not sent at shutdown", "kind", j.kind, "session", j.ref.SessionID)
			unsent++
		}
		n.pending.Done()
	}
}

// next takes the first queued notification. When the queue is empty it
// waits for one if wait is set (until ctx ends), else it reports none.
func (n *Notifier) next(ctx context.Context, wait bool) (job, bool) {
	for {
		n.mu.Lock()
		if len(n.queue) > 0 {
			j := n.queue[0]
			n.queue = n.queue[1:]
			n.mu.Unlock()
			return j, true
		}
		n.mu.Unlock()
		if !wait {
			return job{}, false
		}
		select {
		case <-ctx.Done():
			return job{}, false
		case <-n.wake:
		}
	}
}

func (n *Notifier) requeue(j job) {
	n.mu.Lock()
	n.queue = append([]job{j}, n.queue...)
	n.mu.Unlock()
}

// Flush waits until every queued notification was sent, dropped or left
// unsent by Drain (tests).
func (n *Notifier) Flush() { n.pending.Wait() }

// send delivers j, retrying while the session service is unavailable, and
// reports whether j is done with: delivered, or dropped (not retryable, or
// still failing after giveUp). It reports false when ctx ended first.
func (n *Notifier) send(ctx context.Context, j job) bool {
	n.log.Info("route notification", "kind", j.kind, "session", j.ref.SessionID, "sandbox", j.ref.SandboxID)
	if n.client == nil {
		return true
	}
	deadline := time.Now().Add(n.giveUp)
	backoff := 100 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := j.call(cctx, n.client)
		cancel()
		switch {
		case err == nil:
			return true
		case ctx.Err() != nil:
			return false
		case !retryable(err) || time.Now().After(deadline):
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

func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted, codes.Internal, codes.Unknown:
		return true
	}
	return false
}

func (n *Notifier) enqueue(kind string, ref driver.RouteRef, call func(context.Context, sessionv1.SessionNotifyServiceClient) error) {
	n.pending.Add(1)
	n.mu.Lock()
	n.queue = append(n.queue, job{kind: kind, ref: ref, call: call})
	n.mu.Unlock()
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// Progress reports a preparation step.
func (n *Notifier) Progress(ref driver.RouteRef, step driver.ProgressStep) {
	pb := wrapperconn.ProgressProto(step)
	n.enqueue("progress", ref, func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteProgress(ctx, &sessionv1.NotifyRouteProgressRequest{Route: refProto(ref), Progress: pb})
		return err
	})
}

// Ready reports a ready route served by wrapper instance.
func (n *Notifier) Ready(ref driver.RouteRef, runtimeSessionID, instance string) {
	n.enqueue("ready", ref, func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteReady(ctx, &sessionv1.NotifyRouteReadyRequest{Route: refProto(ref), RuntimeSessionId: runtimeSessionID, WrapperInstance: instance})
		return err
	})
}

// Reconnecting reports a dropped control stream.
func (n *Notifier) Reconnecting(ref driver.RouteRef) {
	n.enqueue("reconnecting", ref, func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteReconnecting(ctx, &sessionv1.NotifyRouteReconnectingRequest{Route: refProto(ref)})
		return err
	})
}

// Failed reports a failed preparation.
func (n *Notifier) Failed(ref driver.RouteRef, reason string, retry bool) {
	n.enqueue("failed", ref, func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteFailed(ctx, &sessionv1.NotifyRouteFailedRequest{Route: refProto(ref), Reason: reason, Retryable: retry})
		return err
	})
}

// Lost reports a route whose wrapper is gone.
func (n *Notifier) Lost(ref driver.RouteRef, reason string) {
	n.enqueue("lost", ref, func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRouteLost(ctx, &sessionv1.NotifyRouteLostRequest{Route: refProto(ref), Reason: reason})
		return err
	})
}

// Events forwards runtime events.
func (n *Notifier) Events(ref driver.RouteRef, evs []driver.RuntimeEvent) {
	events := wrapperconn.EventsProto(evs)
	n.enqueue("events", ref, func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyRuntimeEvents(ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: refProto(ref), Events: events})
		return err
	})
}

// Outcome forwards a turn outcome.
func (n *Notifier) Outcome(ref driver.RouteRef, outcome driver.TurnOutcome) {
	o := wrapperconn.OutcomeProto(outcome)
	n.enqueue("outcome", ref, func(ctx context.Context, c sessionv1.SessionNotifyServiceClient) error {
		_, err := c.NotifyTurnOutcome(ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: refProto(ref), Outcome: o})
		return err
	})
}
