package grpcapi

import (
	"context"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// UpdateEgressPolicy replaces a session's egress policy; it returns once
// the sandbox's egress proxy applies it to new connections.
func (a *SessionAPI) UpdateEgressPolicy(ctx context.Context, r *sessionv1.UpdateEgressPolicyRequest) (*sessionv1.UpdateEgressPolicyResponse, error) {
	if err := validateSessionID(r.GetSessionId()); err != nil {
		return nil, a.fail(ctx, err)
	}
	s, err := a.svc.UpdateEgress(ctx, r.GetSessionId(), egressFromProto(r.GetEgress()), r.GetExpectedVersion())
	if err != nil {
		return nil, a.fail(ctx, err)
	}
	return &sessionv1.UpdateEgressPolicyResponse{Egress: egressToProto(s.Egress), Version: s.EgressVersion}, nil
}
