package service

import (
	"context"
	"time"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// suspendWait bounds how long SuspendSession waits for the runtime's
// absence to be verified before it answers SUSPEND_PENDING (the stop goes
// on; a repeated call reports it). A stop's watchdog is 45 s.
const suspendWait = 30 * time.Second

// resumeWait bounds how long ResumeSession waits for a ready route when
// the caller set no deadline of its own.
const resumeWait = 5 * time.Minute

// Suspend stops the runtime of the session's route, as the idle stop does,
// and returns once its processes are verified absent: the route is then
// suspended (DESIGN.md 3.8). Queued or accepted work refuses it
// (session.ErrTurnRunning) unless force, which cancels that work and sends
// the running turn an abort first. Idempotent.
func (s *Service) Suspend(ctx context.Context, id string, force bool) (*session.Session, error) {
	return s.suspend(ctx, id, suspendWait, func(a *session.Aggregate) (bool, error) { return a.BeginSuspend(force, s.now()) })
}

// suspend is Suspend with its first step: begin checks (and may change)
// the session and says whether a running turn is to be aborted. It waits
// up to wait for the absence to be verified: only then is the route
// suspended.
func (s *Service) suspend(ctx context.Context, id string, wait time.Duration, begin func(*session.Aggregate) (abort bool, err error)) (*session.Session, error) {
	var abort bool
	a, err := s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		var err error
		abort, err = begin(a)
		return err
	})
	if err != nil {
		return nil, err
	}
	if abort {
		s.abort(ctx, &a.Session, "")
	}
	ref := RouteRef{SessionID: id, SandboxID: a.Session.SandboxID, Tenant: session.Tenant{Org: a.Session.OrgID, User: a.Session.UserID}}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		pctx, pcancel := s.peerCtx(wctx)
		verified, retry, err := s.sandbox.SuspendRoute(pctx, ref)
		pcancel()
		if err != nil {
			return nil, err
		}
		if verified {
			break
		}
		retry = max(retry, 50*time.Millisecond)
		if !sleep(wctx, retry) {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, &session.SuspendPendingError{RetryAfter: retry}
		}
	}
	a, err = s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		if a.Intent != nil {
			return session.ErrSessionNotFound
		}
		a.Suspended(s.now())
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &a.Session, nil
}

// Resume prepares the session's route again, as any message does, and
// returns once it is ready. A ready route is returned as it is; a route
// that fails to prepare is a *session.RouteFailedError. With restart, a
// route that failed resume_state_lost (before or during this call) is
// prepared once more with a new conversation.
func (s *Service) Resume(ctx context.Context, id string, restart bool) (*session.Session, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, resumeWait)
		defer cancel()
	}
	pause := 20 * time.Millisecond
	asked, restarted := false, false
	for {
		a, err := s.store.Read(ctx, id, store.Load{})
		if err != nil {
			return nil, err
		}
		if a.Intent != nil || a.Session.State == session.StateDeleting {
			return nil, session.ErrSessionNotFound
		}
		switch a.Session.Route.State {
		case session.RouteReady:
			return &a.Session, nil
		case session.RouteFailed:
			fresh := restart && !restarted && a.Session.Route.FailureReason == session.ReasonResumeStateLost
			if asked && !fresh {
				return nil, &session.RouteFailedError{Reason: a.Session.Route.FailureReason}
			}
			if _, retry := s.prepare(ctx, &a.Session, fresh); !retry {
				asked, restarted = true, restarted || fresh
			}
		case session.RouteSuspended, session.RouteUnknown, "":
			if a.Session.Route.State == session.RouteSuspended && a.Session.ResumeSince.IsZero() {
				// The resume latency counts from this call (metrics.go).
				if _, err := s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
					a.BeginResume(s.now())
					return nil
				}); err != nil {
					return nil, err
				}
			}
			// Prepare is idempotent; asked again after a route lost meanwhile.
			if _, retry := s.prepare(ctx, &a.Session, false); !retry {
				asked = true
			}
		}
		if !sleep(ctx, pause) {
			return nil, ctx.Err()
		}
		pause = min(2*pause, 500*time.Millisecond)
	}
}
