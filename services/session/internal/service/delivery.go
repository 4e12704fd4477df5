package service

import (
	"context"
	"time"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// kick makes sure one drain runs for the session soon. Drains of one session
// never overlap in this process, so queued messages go out once and in
// order; a kick during a drain makes it run once more. (Across replicas two
// drains may overlap; delivery of queued messages is at-least-once by design
// and accepted messages are never replayed.)
func (s *Service) kick(id string) {
	s.mu.Lock()
	if s.running[id] {
		s.again[id] = true
		s.mu.Unlock()
		return
	}
	s.running[id] = true
	s.mu.Unlock()
	s.wg.Go(func() {
		for {
			s.drain(s.ctx, id)
			s.mu.Lock()
			if !s.again[id] || s.ctx.Err() != nil {
				delete(s.running, id)
				delete(s.again, id)
				s.mu.Unlock()
				return
			}
			delete(s.again, id)
			s.mu.Unlock()
		}
	})
}

// drain moves queued messages forward: delivered when the route is ready,
// otherwise the route is prepared. Preparing and reconnecting routes are
// left alone: a notification will kick again.
func (s *Service) drain(ctx context.Context, id string) {
	// A failed peer call is retried a few times with growing pauses; after
	// that the messages stay queued until the next kick (a notification or
	// a new message) or their backstop.
	pause := 50 * time.Millisecond
	for range 8 {
		a, err := s.store.Read(ctx, id, store.Load{Content: true})
		if err != nil {
			if !ErrNotFound(err) && ctx.Err() == nil {
				s.log.WarnContext(ctx, "drain: load failed", "session_id", id, "error", err)
			}
			return
		}
		queued := a.Queued()
		if a.Intent != nil || len(queued) == 0 {
			return
		}
		var more, retry bool
		switch a.Session.Route.State {
		case session.RouteReady:
			more, retry = s.deliver(ctx, a, queued)
		case session.RouteUnknown, session.RouteFailed, "":
			more, retry = s.prepare(ctx, &a.Session)
		}
		if retry {
			select {
			case <-ctx.Done():
				return
			case <-time.After(pause):
			}
			pause *= 2
			continue
		}
		if !more {
			return
		}
	}
}

// deliver sends queued messages; it reports whether draining should go on
// and whether a failed call should be retried.
func (s *Service) deliver(ctx context.Context, a *session.Aggregate, queued []*session.Message) (more, retry bool) {
	id := a.Session.ID
	pctx, cancel := s.peerCtx(ctx)
	sent, view, err := s.sandbox.Deliver(pctx, &a.Session, queued)
	cancel()
	if err != nil {
		s.log.WarnContext(ctx, "deliver failed", "session_id", id, "error", err)
		return false, true
	}
	ids := make([]string, len(queued))
	for i, m := range queued {
		ids[i] = m.ID
	}
	snap := a.Session.Route
	_, err = s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		if sent {
			a.Accept(ids, s.now())
			return nil
		}
		// NOT_READY: nothing was written; take the sandbox's view unless a
		// notification changed the route meanwhile (it is newer).
		if view.State == session.RouteReady {
			view.State = session.RouteUnknown
		}
		if sameRoute(a.Session.Route, snap) {
			s.applyView(a, view)
		}
		return nil
	})
	if err != nil {
		s.log.WarnContext(ctx, "drain: state not saved", "session_id", id, "error", err)
		return false, true
	}
	return !sent, false
}

// prepare asks the sandbox for the route; it reports whether draining
// should go on (the route came back ready) and whether to retry a failure.
func (s *Service) prepare(ctx context.Context, sess *session.Session) (more, retry bool) {
	pctx, cancel := s.peerCtx(ctx)
	view, err := s.sandbox.Prepare(pctx, sess)
	cancel()
	if err != nil {
		s.log.WarnContext(ctx, "prepare failed", "session_id", sess.ID, "error", err)
		return false, true
	}
	snap := sess.Route
	changed := false
	a, err := s.update(ctx, sess.ID, store.Load{}, func(a *session.Aggregate) error {
		// A notification that arrived while Prepare ran is newer than its answer.
		changed = !sameRoute(a.Session.Route, snap)
		if a.Intent == nil && !changed {
			s.applyView(a, view)
		}
		return nil
	})
	if err != nil {
		return false, true
	}
	return changed || a.Session.Route.State == session.RouteReady, false
}

func sameRoute(a, b session.RouteView) bool {
	return a.State == b.State && a.UpdateTime.Equal(b.UpdateTime) && a.WrapperInstance == b.WrapperInstance
}

// applyView takes a route view the sandbox returned synchronously.
func (s *Service) applyView(a *session.Aggregate, v session.RouteView) {
	n := session.Notice{SandboxID: a.Session.SandboxID}
	now := s.now()
	switch v.State {
	case session.RouteReady:
		a.Ready(n, v.RuntimeSessionID, v.WrapperInstance, now)
	case session.RouteReconnecting:
		a.Reconnecting(n, now)
	case session.RouteFailed:
		a.Failed(n, v.FailureReason, now)
	default:
		a.Preparing(n, v.Step, now)
	}
}
