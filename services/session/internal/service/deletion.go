package service

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Delete persists the deletion intent, then tries to finish the deletion at
// once. Until the absence of the session's processes is verified it returns
// a *session.DeletionPendingError and the reconciler keeps going.
func (s *Service) Delete(ctx context.Context, id string) error {
	if err := s.beginDeletion(ctx, id, "client", time.Time{}); err != nil {
		return err
	}
	return s.reconcile(ctx, id)
}

// beginDeletion persists the intent once. With idleBefore set (retention),
// a session updated since then is left alone.
func (s *Service) beginDeletion(ctx context.Context, id, reason string, idleBefore time.Time) error {
	_, err := s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		if !idleBefore.IsZero() && a.Intent == nil && a.Session.UpdateTime.After(idleBefore) {
			return errNotIdle
		}
		a.BeginDeletion(reason, s.now())
		return nil
	})
	return err
}

var errNotIdle = errors.New("session is not idle")

// ReconcileDue drives every deletion whose next attempt is due.
func (s *Service) ReconcileDue(ctx context.Context) {
	ids, err := s.store.DueDeletions(ctx, s.now(), 100)
	if err != nil {
		s.log.WarnContext(ctx, "reconciler: due deletions not read", "error", err)
		return
	}
	for _, id := range ids {
		if err := s.reconcile(ctx, id); err != nil {
			var pending *session.DeletionPendingError
			if !errors.As(err, &pending) {
				s.log.WarnContext(ctx, "reconciler: deletion attempt failed", "session_id", id, "error", err)
			}
		}
	}
}

// reconcile runs one deletion attempt under the session's fenced lease:
// release the route (the sandbox removes the member from its runtime key and
// worktree scope; verified absence required), delete the backing
// credential, delete history, wipe. Each finished step is persisted, so a later attempt
// resumes where this one stopped; an unfinished step persists the backoff.
func (s *Service) reconcile(ctx context.Context, id string) (err error) {
	ctx, span := tracer.Start(ctx, "session.delete")
	defer span.End()
	defer func() { s.metrics.deletionFailed(err) }()
	lease, err := s.store.DeletionLease(ctx, id, s.cfg.Owner, s.cfg.DeletionLeaseTTL)
	if errors.Is(err, fence.ErrLeaseHeld) {
		return &session.DeletionPendingError{RetryAfter: s.cfg.DeletionBackoff.Base, Step: "in_progress"}
	}
	if err != nil {
		return err
	}
	defer func() {
		// A lost lease only means another reconciler may take over.
		_ = lease.Release(context.WithoutCancel(ctx))
	}()
	in, err := s.store.Intent(ctx, id)
	if err != nil {
		return err
	}
	if in == nil {
		if _, err := s.store.Get(ctx, id); err == nil {
			return errors.New("session has no deletion intent")
		}
		return nil // already wiped
	}
	postpone := func(step string, peerAsked time.Duration, cause error) error {
		if cause != nil {
			s.log.WarnContext(ctx, "deletion step not done", "session_id", id, "step", step, "error", cause)
		}
		delay := in.Postpone(s.cfg.DeletionBackoff, step, peerAsked, s.now())
		if err := s.store.SaveIntent(ctx, lease, in); err != nil {
			return err
		}
		return &session.DeletionPendingError{RetryAfter: delay, Step: step}
	}
	save := func() error { return s.store.SaveIntent(ctx, lease, in) }

	if !in.RouteReleased {
		sctx, step := tracer.Start(ctx, "session.delete.release_route")
		pctx, cancel := s.peerCtx(sctx)
		rel, err := s.sandbox.ReleaseRoute(pctx, in.SessionID, in.SandboxID, "session-delete")
		cancel()
		step.End()
		switch {
		case err != nil:
			// Could not ask: never read as absence.
			return postpone("release_route", 0, err)
		case rel.ExhaustedFinal:
			// DESIGN.md 3.5: an exhausted lease allows deletion after a final
			// observation; the sandbox keeps tracking the lease.
			s.log.WarnContext(ctx, "deletion continues on an exhausted wrapper lease (absence not verified)", "session_id", id)
		case !rel.AbsenceVerified:
			return postpone("verify_absence", rel.RetryAfter, nil)
		}
		in.RouteReleased = true
		if err := save(); err != nil {
			return err
		}
	}
	if !in.CredentialReleased {
		if s.creds != nil {
			var err error
			if in.CredentialRef != "" {
				sctx, step := tracer.Start(ctx, "session.delete.delete_credential")
				pctx, cancel := s.peerCtx(sctx)
				err = s.creds.DeleteBacking(pctx, in.CredentialRef)
				cancel()
				step.End()
			}
			if err == nil && in.GitCredentialRef != "" {
				pctx, cancel := s.peerCtx(ctx)
				err = s.creds.DeleteBacking(pctx, in.GitCredentialRef)
				cancel()
			}
			if err != nil {
				return postpone("delete_credential", 0, err)
			}
		} else {
			s.log.InfoContext(ctx, "credential service not configured: credential release skipped", "session_id", id)
		}
		in.CredentialReleased = true
		if err := save(); err != nil {
			return err
		}
	}
	if !in.HistoryDeleted {
		if s.history != nil {
			// Every runtime session the session ever had, not only the
			// latest: each re-preparation started a new history.
			for _, rsid := range in.HistoryIDs() {
				sctx, step := tracer.Start(ctx, "session.delete.delete_history")
				pctx, cancel := s.peerCtx(sctx)
				err := s.history.Delete(pctx, rsid)
				cancel()
				step.End()
				if err != nil {
					return postpone("delete_history", 0, err)
				}
			}
		} else {
			s.log.InfoContext(ctx, "ingest service not configured: history deletion skipped", "session_id", id)
		}
		in.HistoryDeleted = true
		if err := save(); err != nil {
			return err
		}
	}
	loc := store.WipeLocator{SandboxID: in.SandboxID, Directory: in.Directory}
	wctx, wipe := tracer.Start(ctx, "session.delete.wipe")
	err = s.store.Wipe(wctx, lease, in, loc)
	wipe.End()
	if err != nil {
		return err
	}
	s.log.InfoContext(ctx, "session deleted", "session_id", id, "reason", in.Reason, "attempts", in.Attempts+1)
	s.metrics.deletion("deleted", in.CreateTime, s.now())
	return nil
}
