package service

import (
	"context"
	"fmt"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// UpdateEgress replaces a session's egress policy (versioned: expected 0
// replaces whatever is current) and returns once the sandbox service has
// it, so the runtime's next connection is decided on it. The stored
// policy and its version stay when the sandbox cannot be reached (the
// error says so; Prepare carries the stored policy whenever the route is
// prepared again, and a retry sends it once more).
func (s *Service) UpdateEgress(ctx context.Context, id string, p egresspolicy.Policy, expected uint64) (*session.Session, error) {
	if err := session.Invalid(session.CheckEgress("egress", p, s.cfg.EgressMaxRules)); err != nil {
		return nil, err
	}
	a, err := s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		_, err := a.SetEgress(p, expected, s.now())
		return err
	})
	if err != nil {
		return nil, err
	}
	sess := a.Session
	pctx, cancel := s.peerCtx(ctx)
	defer cancel()
	if err := s.sandbox.UpdateEgress(pctx, &sess); err != nil {
		return nil, fmt.Errorf("%w: sandbox: %w", session.ErrPeerUnavailable, err)
	}
	return &sess, nil
}
