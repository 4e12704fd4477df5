package service

import (
	"context"
	"time"

	"agentplane.dev/pkg/storeerr"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// kick makes sure one drain runs for the session soon. Drains of one session
// never overlap in this process, so queued messages go out once and in
// order; a kick during a drain makes it run once more. (Across replicas two
// drains may overlap; delivery of queued messages is at-least-once by design
// and accepted messages are never replayed.)
func (s *Service) kick(id string) { s.kickFrom(id, nil, 0) }

// drainStripes spreads sessions over drain generation counters: a counter
// moves whenever a drain of one of its sessions ends a round (no cleanup
// needed; sessions sharing a stripe only cost each other a re-read).
const drainStripes = 1024

func stripe(id string) int {
	h := uint32(2166136261) // FNV-1a
	for i := 0; i < len(id); i++ {
		h = (h ^ uint32(id[i])) * 16777619
	}
	return int(h % drainStripes)
}

// drainGen is read before a transition loads the state it hands to kickFrom.
func (s *Service) drainGen(id string) uint64 { return s.drained[stripe(id)].Load() }

// kickFrom is kick with the state a transition just committed (snap, loaded
// after drainGen returned gen). When no drain ran for the session since,
// the new drain starts from snap instead of reading the session again: one
// Redis round trip less per message. snap is no staler than a fresh read
// would be for this process's drains, which is what keeps a message from
// going out twice; changes by other writers race with a fresh read alike.
func (s *Service) kickFrom(id string, snap *session.Aggregate, gen uint64) {
	st := &s.drained[stripe(id)]
	s.mu.Lock()
	if s.running[id] {
		s.again[id] = true
		s.mu.Unlock()
		return
	}
	s.running[id] = true
	// A drain that ended since snap was loaded has moved the stripe (before
	// it left running, under s.mu, so this check sees it).
	if snap != nil && st.Load() != gen {
		snap = nil
	}
	s.mu.Unlock()
	s.wg.Go(func() {
		for {
			dctx, span := tracer.Start(s.traces.drainCtx(s.ctx, id), "session.drain")
			s.drain(dctx, id, snap)
			span.End()
			snap = nil
			st.Add(1)
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
// left alone: a notification will kick again. snap, when set, is a state
// just committed, used instead of the first read when it holds the text of
// every queued message.
func (s *Service) drain(ctx context.Context, id string, snap *session.Aggregate) {
	// A failed peer call, or a read the store could not answer (Redis
	// failing over), is retried a few times with growing pauses (6s in
	// all); after that the messages stay queued until the next kick (a
	// notification or a new message) or their backstop.
	pause := 50 * time.Millisecond
	for range 8 {
		if ctx.Err() != nil { // the service stopped its loops: no more peer calls
			return
		}
		a, err := snap, error(nil)
		if snap == nil || !hasTexts(snap.Queued()) {
			a, err = s.store.Read(ctx, id, store.Load{Content: true})
		}
		snap = nil
		if err != nil {
			if !ErrNotFound(err) && ctx.Err() == nil {
				s.log.WarnContext(ctx, "drain: load failed", "session_id", id, "error", err)
			}
			if !storeerr.Unavailable(err) || !sleep(ctx, pause) {
				return
			}
			pause *= 2
			continue
		}
		queued := a.Queued()
		if a.Intent != nil || len(queued) == 0 {
			return
		}
		var more, retry bool
		switch a.Session.Route.State {
		case session.RouteReady:
			more, retry = s.deliver(ctx, a, queued)
		case session.RouteUnknown, session.RouteFailed, session.RouteSuspended, "":
			more, retry = s.prepare(ctx, &a.Session, false)
		}
		if retry {
			if !sleep(ctx, pause) {
				return
			}
			pause *= 2
			continue
		}
		if !more {
			return
		}
	}
}

// sleep pauses for d; false when ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}

// hasTexts reports whether every message carries its text (a message has
// at least one byte; a transition loads only the texts it asked for).
func hasTexts(ms []*session.Message) bool {
	for _, m := range ms {
		if m.Content == "" {
			return false
		}
	}
	return true
}

// deliver sends queued messages; it reports whether draining should go on
// and whether a failed call should be retried.
func (s *Service) deliver(ctx context.Context, a *session.Aggregate, queued []*session.Message) (more, retry bool) {
	id := a.Session.ID
	pctx, cancel := s.peerCtx(ctx)
	sent, view, err := s.sandbox.Deliver(pctx, &a.Session, queued)
	cancel()
	if err != nil {
		if ctx.Err() == nil { // a stopping service's cancelled call is no failure
			s.log.WarnContext(ctx, "deliver failed", "session_id", id, "error", err)
		}
		return false, true
	}
	ids := make([]string, len(queued))
	for i, m := range queued {
		ids[i] = m.ID
	}
	snap := a.Session.Route
	_, err = s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		if sent {
			s.traces.delivered(id)
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
func (s *Service) prepare(ctx context.Context, sess *session.Session, restart bool) (more, retry bool) {
	pctx, cancel := s.peerCtx(ctx)
	view, err := s.sandbox.Prepare(pctx, sess, restart)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "prepare failed", "session_id", sess.ID, "error", err)
		}
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

// sameRoute reports whether no notification changed the route since b was
// read. Every field counts, not only state and time: two notifications can
// carry one timestamp (a coarse or fake clock), e.g. failed by one owner and
// then failed again by its successor with a newer token.
func sameRoute(a, b session.RouteView) bool {
	ta, tb := a.UpdateTime, b.UpdateTime
	a.UpdateTime, b.UpdateTime = time.Time{}, time.Time{}
	return a == b && ta.Equal(tb)
}

// applyView takes a route view the sandbox returned synchronously.
func (s *Service) applyView(a *session.Aggregate, v session.RouteView) {
	n := session.Notice{SandboxID: a.Session.SandboxID}
	now := s.now()
	a.SawRuntimeSession(v.RuntimeSessionID, now)
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
