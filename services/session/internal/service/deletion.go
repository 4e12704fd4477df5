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
	if gone, err := s.store.Gone(ctx, id); err != nil || gone {
		// Already wiped: taking the lease would write the session's fence
		// token again, a key the wipe removed.
		return err
	}
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
		switch _, err := s.store.Get(ctx, id); {
		case err == nil:
			return errors.New("session has no deletion intent")
		case errors.Is(err, session.ErrSessionNotFound):
			// Wiped by another reconciler since the Gone check: the lease
			// taken meanwhile wrote the session's fence keys again.
			return s.store.ForgetFence(ctx, id)
		default:
			return err // a store error says nothing about the deletion
		}
	}
	d := &deletionAttempt{s: s, id: id, lease: lease, in: in}
	if err := d.step(ctx, &in.RouteReleased, d.releaseRoute); err != nil {
		return err
	}
	if err := d.step(ctx, &in.CredentialReleased, d.releaseCredentials); err != nil {
		return err
	}
	if err := d.step(ctx, &in.HistoryDeleted, d.deleteHistory); err != nil {
		return err
	}
	return d.wipe(ctx)
}

// deletionAttempt is one attempt at deleting session id, made under its
// deletion lease; in is the persisted intent it advances.
type deletionAttempt struct {
	s     *Service
	id    string
	lease *fence.Lease
	in    *session.DeletionIntent
}

// step runs one deletion step unless an earlier attempt finished it (done),
// and persists that it is finished.
func (d *deletionAttempt) step(ctx context.Context, done *bool, run func(context.Context) error) error {
	if *done {
		return nil
	}
	if err := run(ctx); err != nil {
		return err
	}
	*done = true
	return d.s.store.SaveIntent(ctx, d.lease, d.in)
}

// postpone persists the intent's next attempt after an unfinished step and
// says when it is; peerAsked is the delay the peer asked for, if any.
func (d *deletionAttempt) postpone(ctx context.Context, step string, peerAsked time.Duration, cause error) error {
	if cause != nil {
		d.s.log.WarnContext(ctx, "deletion step not done", "session_id", d.id, "step", step, "error", cause)
	}
	delay := d.in.Postpone(d.s.cfg.DeletionBackoff, step, peerAsked, d.s.now())
	if err := d.s.store.SaveIntent(ctx, d.lease, d.in); err != nil {
		return err
	}
	return &session.DeletionPendingError{RetryAfter: delay, Step: step}
}

// releaseRoute asks the sandbox to release the session's route and to verify
// that none of its processes is left.
func (d *deletionAttempt) releaseRoute(ctx context.Context) error {
	sctx, step := tracer.Start(ctx, "session.delete.release_route")
	pctx, cancel := d.s.peerCtx(sctx)
	rel, err := d.s.sandbox.ReleaseRoute(pctx, RouteRef{SessionID: d.in.SessionID, SandboxID: d.in.SandboxID,
		Tenant: session.Tenant{Org: d.in.OrgID, User: d.in.UserID}}, "session-delete")
	cancel()
	step.End()
	switch {
	case errors.Is(err, session.ErrSandboxTenantMismatch):
		// The sandbox is another tenant's: since CreateSession claims it,
		// only a session stored before tenancy can be here, and no route
		// of it may be driven there any more (decision 54).
		d.s.log.WarnContext(ctx, "deletion: the session's sandbox belongs to another tenant; nothing released", "session_id", d.id)
	case err != nil:
		// Could not ask: never read as absence.
		return d.postpone(ctx, "release_route", 0, err)
	case rel.ExhaustedFinal:
		// DESIGN.md 3.5: an exhausted lease allows deletion after a final
		// observation; the sandbox keeps tracking the lease.
		d.s.log.WarnContext(ctx, "deletion continues on an exhausted wrapper lease (absence not verified)", "session_id", d.id)
	case !rel.AbsenceVerified:
		return d.postpone(ctx, "verify_absence", rel.RetryAfter, nil)
	}
	return nil
}

// releaseCredentials deletes the backing of the session's credential and of
// its git credential.
func (d *deletionAttempt) releaseCredentials(ctx context.Context) error {
	if d.s.creds == nil {
		d.s.log.InfoContext(ctx, "credential service not configured: credential release skipped", "session_id", d.id)
		return nil
	}
	var err error
	if d.in.CredentialRef != "" {
		sctx, step := tracer.Start(ctx, "session.delete.delete_credential")
		pctx, cancel := d.s.peerCtx(sctx)
		err = d.s.creds.DeleteBacking(pctx, d.in.CredentialRef)
		cancel()
		step.End()
	}
	if err == nil && d.in.GitCredentialRef != "" {
		pctx, cancel := d.s.peerCtx(ctx)
		err = d.s.creds.DeleteBacking(pctx, d.in.GitCredentialRef)
		cancel()
	}
	if err != nil {
		return d.postpone(ctx, "delete_credential", 0, err)
	}
	return nil
}

// deleteHistory deletes the history of every runtime session the session
// ever had, not only the latest: each re-preparation started a new history.
func (d *deletionAttempt) deleteHistory(ctx context.Context) error {
	if d.s.history == nil {
		d.s.log.InfoContext(ctx, "ingest service not configured: history deletion skipped", "session_id", d.id)
		return nil
	}
	for _, rsid := range d.in.HistoryIDs() {
		sctx, step := tracer.Start(ctx, "session.delete.delete_history")
		pctx, cancel := d.s.peerCtx(sctx)
		err := d.s.history.Delete(pctx, rsid)
		cancel()
		step.End()
		if err != nil {
			return d.postpone(ctx, "delete_history", 0, err)
		}
	}
	return nil
}

// wipe removes what is left of the session once every step is finished.
func (d *deletionAttempt) wipe(ctx context.Context) error {
	loc := store.WipeLocator{SandboxID: d.in.SandboxID, Directory: d.in.Directory}
	wctx, wipe := tracer.Start(ctx, "session.delete.wipe")
	err := d.s.store.Wipe(wctx, d.lease, d.in, loc, d.s.cfg.WipeLocatorTTL)
	wipe.End()
	if err != nil {
		return err
	}
	d.s.log.InfoContext(ctx, "session deleted", "session_id", d.id, "reason", d.in.Reason, "attempts", d.in.Attempts+1)
	d.s.metrics.deletion("deleted", d.in.CreateTime, d.s.now())
	return nil
}
