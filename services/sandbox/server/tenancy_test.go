package server_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
)

// mallory is a tenant of another org than testTenant's.
var mallory = &sandboxv1.Tenant{OrgId: "evil", UserId: "mallory"}

// asTenant calls every SandboxService method that names a sandbox, as
// tenant tn, naming sandbox; it returns each call's error by method.
func asTenant(svc *service, tn *sandboxv1.Tenant, sandbox string) map[string]error {
	ctx, c := context.Background(), svc.client
	out := map[string]error{}
	r := route(sandbox, "s1", "/repo/a")
	r.Route.OrgId, r.Route.UserId = tn.GetOrgId(), tn.GetUserId()
	_, out["Prepare"] = c.Prepare(ctx, r)
	_, out["ClaimSandbox"] = c.ClaimSandbox(ctx, &sandboxv1.ClaimSandboxRequest{SandboxId: sandbox, Tenant: tn})
	for name, err := range nonCreating(svc, tn, sandbox) {
		out[name] = err
	}
	return out
}

// nonCreating calls the methods that never bind a sandbox.
func nonCreating(svc *service, tn *sandboxv1.Tenant, sandbox string) map[string]error {
	ctx, c := context.Background(), svc.client
	out := map[string]error{}
	_, out["Deliver"] = c.Deliver(ctx, &sandboxv1.DeliverRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1",
		Messages: []*sandboxv1.DeliveryMessage{{MessageId: "evil", Content: "cat /repo/a/secret"}}})
	_, out["Status"] = c.Status(ctx, &sandboxv1.StatusRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1"})
	_, out["Abort"] = c.Abort(ctx, &sandboxv1.AbortRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1"})
	_, out["GetScope"] = c.GetScope(ctx, &sandboxv1.GetScopeRequest{Tenant: tn, SandboxId: sandbox, Directory: "/repo/a"})
	_, out["WorktreeChanges"] = c.WorktreeChanges(ctx, &sandboxv1.WorktreeChangesRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1"})
	_, out["PushWorktree"] = c.PushWorktree(ctx, &sandboxv1.PushWorktreeRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1",
		Branch: "evil", CommitMessage: "evil"})
	_, out["RotateHandle"] = c.RotateHandle(ctx, &sandboxv1.RotateHandleRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1"})
	_, out["UpdateEgressPolicy"] = c.UpdateEgressPolicy(ctx, &sandboxv1.UpdateEgressPolicyRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1",
		Version: 99, Egress: &sandboxv1.EgressPolicy{Allow: []*sandboxv1.EgressRule{{Host: "evil.example", Ports: []uint32{443}}}}})
	_, out["ReleaseRoute"] = c.ReleaseRoute(ctx, &sandboxv1.ReleaseRouteRequest{Tenant: tn, SandboxId: sandbox, SessionId: "s1", Reason: "session-delete"})
	return out
}

// TestSandboxesBelongToOneTenant: alice's sandbox with a ready route, her
// sandbox bound but empty, and a sandbox nobody named answer each of
// mallory's calls with one and the same status, PERMISSION_DENIED
// SANDBOX_TENANT_MISMATCH, so the answer says nothing of what exists. (A
// creating call on a sandbox nobody named binds it: that one is not
// compared.) Alice's route is untouched afterwards.
func TestSandboxesBelongToOneTenant(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, nil)
	live, bound, none := uniqueSandbox(t), uniqueSandbox(t)+"-b", uniqueSandbox(t)+"-n"
	_, from := waitReady(t, svc, n, 0, route(live, "s1", "/repo/a"))
	_, err := svc.client.ClaimSandbox(context.Background(), &sandboxv1.ClaimSandboxRequest{SandboxId: bound, Tenant: testTenant})
	require.NoError(t, err)

	refusals := map[string]map[string]error{"live": asTenant(svc, mallory, live), "bound": asTenant(svc, mallory, bound),
		"none": nonCreating(svc, mallory, none)}
	for method, err := range refusals["live"] {
		require.Equal(t, codes.PermissionDenied, status.Code(err), "%s: %v", method, err)
		require.Equal(t, "SANDBOX_TENANT_MISMATCH", apierr.Reason(err), method)
		for _, other := range []string{"bound", "none"} {
			if o, ok := refusals[other][method]; ok {
				require.True(t, proto.Equal(status.Convert(err).Proto(), status.Convert(o).Proto()),
					"%s: %s answers %v, live %v", method, other, o, err)
			}
		}
	}
	require.Len(t, refusals["live"], 11)
	require.Len(t, refusals["none"], 9)

	// Alice's sandbox is still hers and her route serves her turn.
	st, err := svc.client.Status(context.Background(), &sandboxv1.StatusRequest{Tenant: testTenant, SandboxId: live, SessionId: "s1"})
	require.NoError(t, err)
	require.Equal(t, sandboxv1.RouteState_ROUTE_STATE_READY, st.GetRoute().GetState())
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, live, "s1", "m1", "hello"))
	out, _ := n.wait(t, from, "outcome", "s1")
	require.Equal(t, "m1", out.Text, "only alice's message ran")
}

// The tenant is required: a call without one is invalid, never treated as
// any tenant's.
func TestCallsWithoutTenantAreInvalid(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, nil)
	sb := uniqueSandbox(t)
	for method, err := range nonCreating(svc, nil, sb) {
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", method, err)
	}
	r := route(sb, "s1", "/repo/a")
	r.Route.OrgId = ""
	_, err := svc.client.Prepare(context.Background(), r)
	require.Equal(t, codes.InvalidArgument, status.Code(err))
}
