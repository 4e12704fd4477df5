package grpcapi

import (
	"context"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/tenancy"
)

// Tenants binds sandboxes to tenants and checks them (tenancy.Binder).
type Tenants interface {
	// Claim binds the sandbox to t unless it is bound, then checks it.
	Claim(ctx context.Context, sandboxID string, t tenancy.Tenant) error
	// Check checks that the sandbox belongs to t.
	Check(ctx context.Context, sandboxID string, t tenancy.Tenant) error
}

// tenantRule is the field-violation text of a missing or bad tenant.
const tenantRule = "org_id and user_id, each 1-64 of [A-Za-z0-9_-]"

// checkTenant converts a request's tenant, recording a violation under
// field when it is missing or malformed (never a mismatch: that is only
// decided, after validation, against the sandbox's binding).
func checkTenant(v *violations, field string, t *sandboxv1.Tenant) tenancy.Tenant {
	v.check(validID(t.GetOrgId()) && validID(t.GetUserId()), field, tenantRule)
	return tenancy.Tenant{Org: t.GetOrgId(), User: t.GetUserId()}
}

// ownedBy answers nil when the sandbox belongs to t, and the translated
// SANDBOX_TENANT_MISMATCH otherwise: before the driver looks at anything,
// so the answer is the same whether the sandbox exists or not.
func (s *Sandbox) ownedBy(ctx context.Context, sandboxID string, t tenancy.Tenant) error {
	if err := s.Tenants.Check(ctx, sandboxID, t); err != nil {
		return toStatus(ctx, s.Log, err)
	}
	return nil
}

// ClaimSandbox binds a sandbox to the caller's tenant, or refuses.
func (s *Sandbox) ClaimSandbox(ctx context.Context, req *sandboxv1.ClaimSandboxRequest) (*sandboxv1.ClaimSandboxResponse, error) {
	var v violations
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid claim"); err != nil {
		return nil, err
	}
	if err := s.Tenants.Claim(ctx, req.GetSandboxId(), t); err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.ClaimSandboxResponse{}, nil
}
