package grpcapi

import (
	"context"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/egresspolicy"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
)

// checkEgress converts a policy, recording its problems under field. The
// session service enforces its deployment's size; this is the ceiling.
func checkEgress(v *violations, field string, p *sandboxv1.EgressPolicy) egresspolicy.Policy {
	out := egresspolicy.Policy{PrivateNetworks: p.GetPrivateNetworks()}
	for _, r := range p.GetAllow() {
		out.Allow = append(out.Allow, egresspolicy.Rule{Host: r.GetHost(), Ports: r.GetPorts()})
	}
	for _, pr := range out.Validate(egresspolicy.MaxRulesCeiling) {
		v.check(false, field+"."+pr.Field, pr.Description)
	}
	return out
}

// UpdateEgressPolicy sets a route's egress policy (fenced, versioned).
func (s *Sandbox) UpdateEgressPolicy(ctx context.Context, req *sandboxv1.UpdateEgressPolicyRequest) (*sandboxv1.UpdateEgressPolicyResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(req.GetVersion() > 0, "version", "a positive version")
	p := checkEgress(&v, "egress", req.GetEgress())
	t := checkTenant(&v, "tenant", req.GetTenant())
	if len(v) > 0 {
		return nil, apierr.Error(codes.InvalidArgument, ReasonInvalidEgress, "invalid egress policy", v...)
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	applied, err := s.Driver.UpdateEgress(ctx, req.GetSandboxId(), req.GetSessionId(), p, req.GetVersion())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.UpdateEgressPolicyResponse{Applied: applied}, nil
}
