package service

import (
	"context"
	"errors"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Sweep applies the backstops to sessions with overdue work and starts the
// deletion of sessions idle longer than the retention. Tests call it with an
// injected clock; in production it runs every SweepInterval.
func (s *Service) Sweep(ctx context.Context) {
	now := s.now()
	ids, err := s.store.DueActive(ctx, now, 200)
	if err != nil {
		s.log.WarnContext(ctx, "sweep: due sessions not read", "error", err)
	}
	for _, id := range ids {
		var before states
		a, err := s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
			before = statesOf(a)
			s.cfg.Backstops.Apply(a, now)
			return nil
		})
		if err == nil {
			s.metrics.backstopped(before, a)
			if s.cfg.Backstops.Stalled(a, now) {
				// Its drain may have died with another replica: drain
				// here (delivery is at-least-once; a preparing route is
				// left alone).
				s.kick(id)
			}
		}
		if ErrNotFound(err) {
			_ = s.store.Unindex(ctx, id)
		} else if err != nil {
			s.log.WarnContext(ctx, "sweep: backstop not applied", "session_id", id, "error", err)
		}
	}
	if s.cfg.Retention <= 0 {
		return
	}
	cutoff := now.Add(-s.cfg.Retention)
	idle, err := s.store.Idle(ctx, cutoff, 100)
	if err != nil {
		s.log.WarnContext(ctx, "sweep: idle sessions not read", "error", err)
	}
	for _, id := range idle {
		err := s.beginDeletion(ctx, id, "retention", cutoff)
		switch {
		case ErrNotFound(err):
			_ = s.store.Unindex(ctx, id)
			continue
		case errors.Is(err, errNotIdle):
			continue
		case err != nil:
			s.log.WarnContext(ctx, "retention: deletion not started", "session_id", id, "error", err)
			continue
		}
		s.log.InfoContext(ctx, "retention: deleting idle session", "session_id", id)
		var pending *session.DeletionPendingError
		if err := s.reconcile(ctx, id); err != nil && !errors.As(err, &pending) {
			s.log.WarnContext(ctx, "retention: deletion attempt failed", "session_id", id, "error", err)
		}
	}
}
