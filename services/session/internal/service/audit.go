package service

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// ProxyReport is one request the credential proxy forwarded, as it
// reported it (SessionNotifyService.NotifyAudit).
type ProxyReport struct {
	SessionID, SandboxID, RuntimeSessionID, RuntimeKey string
	Start                                              time.Time
	Request                                            session.AuditProxy
}

// maxClockAhead bounds how far ahead of this service's clock a reported
// time may be; later ones are taken as now (another host's clock).
const maxClockAhead = time.Minute

// reportedTime is t, or now when t is unset or too far ahead.
func (s *Service) reportedTime(t time.Time) time.Time {
	now := s.now()
	if t.IsZero() || t.After(now.Add(maxClockAhead)) {
		return now
	}
	return t
}

// AuditProxyRequests stores the proxy's reports as audit records of their
// sessions, each attributed to the turn running at its start (else the
// next: session.Aggregate.TurnAt). A report for an unknown or deleting
// session, or from another sandbox than the session's, is dropped.
func (s *Service) AuditProxyRequests(ctx context.Context, reports []ProxyReport) error {
	var order []string
	by := map[string][]ProxyReport{}
	for _, r := range reports {
		if _, ok := by[r.SessionID]; !ok {
			order = append(order, r.SessionID)
		}
		by[r.SessionID] = append(by[r.SessionID], r)
	}
	var errs []error
	for _, id := range order {
		a, err := s.store.Read(ctx, id, store.Load{})
		if ErrNotFound(err) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if a.Session.State == session.StateDeleting || a.Intent != nil {
			continue
		}
		var recs []session.AuditRecord
		for _, r := range by[id] {
			if r.SandboxID != a.Session.SandboxID {
				continue
			}
			t := s.reportedTime(r.Start)
			req := r.Request
			recs = append(recs, session.AuditRecord{
				TurnID: a.TurnAt(t), RuntimeKey: r.RuntimeKey, RuntimeSessionID: r.RuntimeSessionID,
				Kind: session.AuditKindProxy, Time: t, Proxy: &req,
			})
		}
		if _, err := s.store.AppendAudit(ctx, id, recs); err != nil && !ErrNotFound(err) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ListAudit pages a live session's audit records (NOT_FOUND once it is
// being deleted, as ExportHistory).
func (s *Service) ListAudit(ctx context.Context, id, after, turn string, size int) ([]session.AuditRecord, string, error) {
	if live, err := s.store.Live(ctx, id); err != nil {
		return nil, "", err
	} else if !live {
		return nil, "", session.ErrSessionNotFound
	}
	return s.store.ListAudit(ctx, id, after, turn, size)
}
