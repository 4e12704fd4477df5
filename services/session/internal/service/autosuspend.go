package service

import (
	"context"
	"errors"
	"sync"
	"time"

	"agentplane.dev/services/session/internal/session"
)

// suspendLease is how long a claimed suspend is this replica's: longer
// than one suspend waits (suspendWait), so a claim ends only when its
// replica died or the suspend could not be done (a shared runtime), and
// the session is tried again then.
const suspendLease = 2 * time.Minute

// suspendBatch and suspendWorkers bound one round of SuspendIdle.
const (
	suspendBatch   = 64
	suspendWorkers = 4
)

// errNotDue: a claimed session's suspend is not due on its fresh state (a
// message came since the schedule said so).
var errNotDue = errors.New("suspend not due")

// SuspendIdle suspends the runtimes of sessions idle for their
// suspend_after (DESIGN.md 3.8): each change of a session schedules when
// that is due (session.SuspendPolicy.Due); a replica claims due sessions
// in one atomic step (no two replicas suspend one session) and suspends
// each the way SuspendSession does without force, after checking on the
// session's fresh state that nothing runs or is queued and that it is
// still due. Tests call it with an injected clock; in production it runs
// every SweepInterval.
func (s *Service) SuspendIdle(ctx context.Context) {
	now := s.now()
	ids, err := s.store.ClaimDueSuspends(ctx, now, suspendLease, suspendBatch)
	if err != nil {
		s.log.WarnContext(ctx, "suspend: due sessions not claimed", "error", err)
		return
	}
	work := make(chan string)
	var wg sync.WaitGroup
	for range min(suspendWorkers, len(ids)) {
		wg.Go(func() {
			for id := range work {
				s.suspendIdle(ctx, id, now)
			}
		})
	}
	for _, id := range ids {
		work <- id
	}
	close(work)
	wg.Wait()
}

func (s *Service) suspendIdle(ctx context.Context, id string, now time.Time) {
	// It waits longer than a caller of SuspendSession, who asks again: no
	// one asks again for the sweeper, and until the absence is verified the
	// route is not shown suspended. Within the claim, so no other replica
	// tries meanwhile.
	_, err := s.suspend(ctx, id, suspendLease/2, func(a *session.Aggregate) (bool, error) {
		if due := s.cfg.Suspend.Due(a); due.IsZero() || due.After(now) {
			return false, errNotDue
		}
		return a.BeginSuspend(false, now)
	})
	var pending *session.SuspendPendingError
	switch {
	case err == nil:
		s.metrics.suspendedIdle()
		s.log.InfoContext(ctx, "suspend: idle runtime suspended", "session_id", id)
	case ErrNotFound(err):
		_ = s.store.Unindex(ctx, id)
	case errors.Is(err, errNotDue), errors.Is(err, session.ErrTurnRunning):
		// The change that made it so rewrote the schedule.
	case errors.Is(err, session.ErrRuntimeShared):
		// Other sessions route to the same runtime: it stays up (tried
		// again when the claim ends).
		s.log.DebugContext(ctx, "suspend: runtime shared, left running", "session_id", id)
	case errors.As(err, &pending):
		// The stop goes on past a stop's watchdog: the route stays
		// unknown (not suspended) until a message or a resume prepares it.
		s.log.WarnContext(ctx, "suspend: runtime absence not verified", "session_id", id)
	default:
		s.log.WarnContext(ctx, "suspend: idle runtime not suspended", "session_id", id, "error", err)
	}
}
