package service

import (
	"context"
	"errors"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Notifications from the sandbox service. Each is idempotent; one for an
// unknown or deleting session, another sandbox, or a deposed sandbox owner
// (older fencing token) is acknowledged and dropped.

func (s *Service) notify(ctx context.Context, id string, n session.Notice, load store.Load, fn func(*session.Aggregate)) (*session.Aggregate, error) {
	if err := s.checkNotice(n); err != nil {
		return nil, err
	}
	applied := false
	a, err := s.update(ctx, id, load, func(a *session.Aggregate) error {
		applied = a.Accepts(n)
		if applied {
			fn(a)
		}
		return nil
	})
	if ErrNotFound(err) {
		return nil, nil
	}
	if err != nil || !applied {
		return nil, err
	}
	return a, nil
}

// RouteProgress records a preparation step (payload: the encoded step).
func (s *Service) RouteProgress(ctx context.Context, id string, n session.Notice, step string, payload []byte) error {
	_, err := s.notify(ctx, id, n, store.Load{}, func(a *session.Aggregate) { a.Progress(n, step, payload, s.now()) })
	return err
}

// RouteReady records a ready route and delivers queued messages.
func (s *Service) RouteReady(ctx context.Context, id string, n session.Notice, runtimeSessionID, wrapperInstance string) error {
	a, err := s.notify(ctx, id, n, store.Load{}, func(a *session.Aggregate) {
		a.Ready(n, runtimeSessionID, wrapperInstance, s.now())
	})
	if a != nil {
		s.kick(id)
	}
	return err
}

// RouteReconnecting records a dropped wrapper stream.
func (s *Service) RouteReconnecting(ctx context.Context, id string, n session.Notice) error {
	_, err := s.notify(ctx, id, n, store.Load{}, func(a *session.Aggregate) { a.Reconnecting(n, s.now()) })
	return err
}

// RouteFailed fails queued and accepted work.
func (s *Service) RouteFailed(ctx context.Context, id string, n session.Notice, reason string) error {
	_, err := s.notify(ctx, id, n, store.Load{}, func(a *session.Aggregate) { a.Failed(n, reason, s.now()) })
	return err
}

// RouteLost fails accepted work and prepares again when work is queued.
func (s *Service) RouteLost(ctx context.Context, id string, n session.Notice, reason string) error {
	again := false
	_, err := s.notify(ctx, id, n, store.Load{}, func(a *session.Aggregate) { again = a.Lost(n, reason, s.now()) })
	if again {
		s.kick(id)
	}
	return err
}

// RuntimeEvents appends new runtime events to the log.
func (s *Service) RuntimeEvents(ctx context.Context, id string, n session.Notice, events []store.RuntimeEvent) error {
	if err := s.checkNotice(n); err != nil {
		return err
	}
	a, err := s.store.Read(ctx, id, store.Load{})
	if ErrNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if !a.Accepts(n) || len(events) == 0 {
		return nil
	}
	for i := range events {
		if r := events[i].Audit; r != nil {
			// Egress decisions become audit records of the turn running
			// when they were made, else the next.
			r.Time = s.reportedTime(r.Time)
			r.TurnID = a.TurnAt(r.Time)
		}
	}
	_, err = s.store.AppendRuntime(ctx, id, s.now(), events)
	if errors.Is(err, session.ErrSessionNotFound) {
		return nil
	}
	return err
}

// Outcome is a turn outcome.
type Outcome struct {
	TurnID, LastMessageID string
	Result                session.TurnResult
	FailureReason         string
	Payload               []byte
	// WithUsage encodes the payload with the turn's usage (nil: the
	// payload as it is).
	WithUsage func(session.Usage) []byte
}

// TurnOutcome settles accepted messages up to the outcome's last message.
func (s *Service) TurnOutcome(ctx context.Context, id string, n session.Notice, o Outcome) error {
	load := store.Load{MessageID: o.LastMessageID, SeenIDs: []string{"turn:" + o.TurnID}}
	_, err := s.notify(ctx, id, n, load, func(a *session.Aggregate) {
		a.Outcome("turn:"+o.TurnID, o.LastMessageID, o.Result, o.FailureReason, o.Payload, o.WithUsage, s.now())
	})
	return err
}

// checkNotice refuses a notification whose fencing token no sandbox owner
// issued (zero, or far ahead of the clock) before anything is read.
func (s *Service) checkNotice(n session.Notice) error {
	return session.Invalid(session.CheckFenceToken("route.fence_token", n.FenceToken, s.now()))
}

// Usage counts one provider response's usage (from the credential proxy)
// into the session's totals and its next turn outcome. A report for an
// unknown or deleting session, or from another sandbox than the session's,
// is dropped.
func (s *Service) Usage(ctx context.Context, id, sandboxID string, u session.Usage) error {
	var counted bool
	var profile string
	u.CostUSD = 0
	if cost, ok := s.cfg.Prices.Cost(u); ok {
		u.CostUSD = cost
	}
	_, err := s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		if a.Session.SandboxID != sandboxID || a.Session.State == session.StateDeleting {
			return nil
		}
		a.AddUsage(u)
		counted, profile = true, a.Session.Agent.Profile
		return nil
	})
	if ErrNotFound(err) {
		return nil
	}
	if err == nil && counted {
		s.metrics.usage(profile, u)
	}
	return err
}
