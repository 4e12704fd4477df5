package grpcapi

import (
	"context"
	"log/slog"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/route"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/control/tenancy"
	"agentplane.dev/services/sandbox/internal/edge/wrapperconn"
)

// Sandbox serves SandboxService.
type Sandbox struct {
	sandboxv1.UnimplementedSandboxServiceServer
	Driver  *driver.Driver
	Tenants Tenants      // every call that names a sandbox checks its tenant first
	Log     *slog.Logger // internal errors are logged here (toStatus)
}

var classNames = map[sandboxv1.CredentialClass]string{
	sandboxv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED: "delegated",
	sandboxv1.CredentialClass_CREDENTIAL_CLASS_STATIC:    "static",
}

// Prepare is idempotent and returns at once.
func (s *Sandbox) Prepare(ctx context.Context, req *sandboxv1.PrepareRequest) (*sandboxv1.PrepareResponse, error) {
	r := req.GetRoute()
	var v violations
	v.check(validID(r.GetSessionId()), "route.session_id", idRule)
	v.check(validSandboxID(r.GetSandboxId()), "route.sandbox_id", sandboxIDRule)
	v.check(validDirectory(r.GetDirectory()), "route.directory", "an absolute normalized path")
	_, ok := classNames[r.GetCredentialClass()]
	v.check(ok, "route.credential_class", "DELEGATED or STATIC")
	v.check(len(r.GetRepoUrl()) <= 2048, "route.repo_url", "at most 2048 bytes")
	v.check(len(r.GetCredentialRef()) <= 512, "route.credential_ref", "at most 512 bytes")
	checkAgent(&v, "route.agent", r.GetAgent())
	v.check(len(r.GetGitCredentialRef()) <= 512, "route.git_credential_ref", "at most 512 bytes")
	v.check(len(r.GetRepoRef()) <= 255, "route.repo_ref", "at most 255 bytes")
	egress := checkEgress(&v, "route.egress", r.GetEgress())
	v.check(validID(r.GetOrgId()), "route.org_id", idRule)
	v.check(validID(r.GetUserId()), "route.user_id", idRule)
	if err := v.err("invalid route"); err != nil {
		return nil, err
	}
	// The route's tenant creates the sandbox or must be the one it has.
	if err := s.Tenants.Claim(ctx, r.GetSandboxId(), tenancy.Tenant{Org: r.GetOrgId(), User: r.GetUserId()}); err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	view, err := s.Driver.Prepare(ctx, driver.RouteSpec{
		SessionID: r.GetSessionId(), SandboxID: r.GetSandboxId(), Directory: r.GetDirectory(), RepoURL: r.GetRepoUrl(),
		UserID: r.GetUserId(), OrgID: r.GetOrgId(), CredentialRef: r.GetCredentialRef(), CredentialClass: classNames[r.GetCredentialClass()],
		Agent:   agentToStore(r.GetAgent()),
		RepoRef: r.GetRepoRef(), RepoDepth: r.GetRepoDepth(), GitCredentialRef: r.GetGitCredentialRef(),
		Egress: egress, EgressVersion: r.GetEgressVersion(),
		Restart: req.GetRestart(),
	})
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.PrepareResponse{Route: routeView(view, "")}, nil
}

// Deliver writes messages or answers NOT_READY.
func (s *Sandbox) Deliver(ctx context.Context, req *sandboxv1.DeliverRequest) (*sandboxv1.DeliverResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(len(req.GetMessages()) > 0 && len(req.GetMessages()) <= 256, "messages", "1 to 256 messages")
	msgs := make([]driver.Message, 0, len(req.GetMessages()))
	for _, m := range req.GetMessages() {
		v.check(validID(m.GetMessageId()), "messages.message_id", idRule)
		v.check(len(m.GetContent()) <= 1<<20, "messages.content", "at most 1 MiB")
		msgs = append(msgs, driver.Message{ID: m.GetMessageId(), Content: m.GetContent()})
	}
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid delivery"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	sent, view, err := s.Driver.Deliver(ctx, req.GetSandboxId(), req.GetSessionId(), msgs)
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	res := sandboxv1.DeliveryResult_DELIVERY_RESULT_NOT_READY
	if sent {
		res = sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT
	}
	return &sandboxv1.DeliverResponse{Result: res, Route: routeView(view, "")}, nil
}

// Status describes a sandbox.
func (s *Sandbox) Status(ctx context.Context, req *sandboxv1.StatusRequest) (*sandboxv1.StatusResponse, error) {
	var v violations
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(req.GetSessionId() == "" || validID(req.GetSessionId()), "session_id", idRule)
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid status request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	st, err := s.Driver.Status(ctx, req.GetSandboxId(), req.GetSessionId())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	out := &sandboxv1.StatusResponse{Sandbox: &sandboxv1.SandboxStatus{
		SandboxId: st.SandboxID, Owner: st.Owner, FenceToken: st.FenceToken, AllocationId: st.AllocationID,
		AllocationState: phaseProto(st.Phase),
	}}
	for _, k := range st.Keys {
		out.Sandbox.RuntimeKeys = append(out.Sandbox.RuntimeKeys, &sandboxv1.RuntimeKeyStatus{
			RuntimeKey: k.RuntimeKey, LeaseState: leaseProto(k.Lease), NextGeneration: k.Lease.NextGeneration,
			StopAttempts: uint32(k.Lease.Attempts), MemberSessionIds: k.Members, WrapperInstance: k.Instance,
		})
	}
	if req.GetSessionId() != "" {
		if st.Route != nil {
			out.Route = routeView(*st.Route, st.AllocationID)
		} else {
			out.Route = &sandboxv1.RouteView{SessionId: req.GetSessionId(), State: sandboxv1.RouteState_ROUTE_STATE_UNKNOWN}
		}
	}
	return out, nil
}

// Abort sends a best-effort abort.
func (s *Sandbox) Abort(ctx context.Context, req *sandboxv1.AbortRequest) (*sandboxv1.AbortResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(req.GetMessageId() == "" || validID(req.GetMessageId()), "message_id", idRule)
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid abort"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	sent, err := s.Driver.Abort(ctx, req.GetSandboxId(), req.GetSessionId(), req.GetMessageId())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.AbortResponse{Sent: sent}, nil
}

// ReleaseRoute removes the session from its runtime key.
func (s *Sandbox) ReleaseRoute(ctx context.Context, req *sandboxv1.ReleaseRouteRequest) (*sandboxv1.ReleaseRouteResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(len(req.GetReason()) <= 64, "reason", "at most 64 bytes")
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid release"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	reason := req.GetReason()
	if reason == "" {
		reason = "session-release"
	}
	rel, err := s.Driver.ReleaseRoute(ctx, req.GetSandboxId(), req.GetSessionId(), reason)
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	// EXHAUSTED is reported only when the exhausted lease had its final
	// observation and the deletion may complete (DESIGN.md 3.5); before, an
	// exhausted lease reads as the stop_needed it is.
	state := leaseProto(lease.Lease{State: rel.Lease})
	if rel.ExhaustedFinal {
		state = sandboxv1.LeaseState_LEASE_STATE_EXHAUSTED
	}
	out := &sandboxv1.ReleaseRouteResponse{LastMember: rel.LastMember, AbsenceVerified: rel.AbsenceVerified, LeaseState: state}
	if !rel.AbsenceVerified && !rel.ExhaustedFinal {
		out.RetryAfter = durationpb.New(rel.RetryAfter)
	}
	return out, nil
}

// SuspendRoute stops the route's runtime key (stop reason suspend) and
// reports whether its absence is verified.
func (s *Sandbox) SuspendRoute(ctx context.Context, req *sandboxv1.SuspendRouteRequest) (*sandboxv1.SuspendRouteResponse, error) {
	var v violations
	v.check(validID(req.GetSessionId()), "session_id", idRule)
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid suspend"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	sus, err := s.Driver.SuspendRoute(ctx, req.GetSandboxId(), req.GetSessionId())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	out := &sandboxv1.SuspendRouteResponse{AbsenceVerified: sus.AbsenceVerified}
	if !sus.AbsenceVerified {
		out.RetryAfter = durationpb.New(sus.RetryAfter)
	}
	return out, nil
}

// GetScope returns a worktree scope.
func (s *Sandbox) GetScope(ctx context.Context, req *sandboxv1.GetScopeRequest) (*sandboxv1.GetScopeResponse, error) {
	var v violations
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(validDirectory(req.GetDirectory()), "directory", "an absolute normalized path")
	t := checkTenant(&v, "tenant", req.GetTenant())
	if err := v.err("invalid scope request"); err != nil {
		return nil, err
	}
	if err := s.ownedBy(ctx, req.GetSandboxId(), t); err != nil {
		return nil, err
	}
	sc, err := s.Driver.Scope(ctx, req.GetSandboxId(), req.GetDirectory())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	out := &sandboxv1.WorktreeScope{SandboxId: sc.SandboxID, Directory: sc.Directory, Contract: wrapperconn.ContractProto(sc.Contract)}
	for c, name := range classNames {
		if name == sc.Class {
			out.CredentialClass = c
		}
	}
	for _, id := range sc.SortedMembers() {
		out.Members = append(out.Members, &sandboxv1.ScopeMember{SessionId: id, RuntimeSessionId: sc.Members[id]})
	}
	return &sandboxv1.GetScopeResponse{Scope: out}, nil
}

var routeStates = map[route.State]sandboxv1.RouteState{
	store.RouteUnknown: sandboxv1.RouteState_ROUTE_STATE_UNKNOWN, store.RoutePreparing: sandboxv1.RouteState_ROUTE_STATE_PREPARING,
	store.RouteReady: sandboxv1.RouteState_ROUTE_STATE_READY, store.RouteReconnecting: sandboxv1.RouteState_ROUTE_STATE_RECONNECTING,
	store.RouteFailed: sandboxv1.RouteState_ROUTE_STATE_FAILED, store.RouteReleased: sandboxv1.RouteState_ROUTE_STATE_UNKNOWN,
}

func routeView(r store.Route, alloc string) *sandboxv1.RouteView {
	v := &sandboxv1.RouteView{
		SessionId: r.SessionID, State: routeStates[r.State], Step: r.Step, FailureReason: r.FailureReason, Retryable: r.Retryable,
		RuntimeSessionId: r.RuntimeSessionID, RuntimeKey: r.RuntimeKey, Contract: wrapperconn.ContractProto(r.Contract),
		AllocationId: alloc, WrapperInstance: r.WrapperInstance,
	}
	if r.Agent.Profile != "" {
		v.Agent = &sandboxv1.Agent{Profile: r.Agent.Profile, Model: r.Agent.Model, RejectToolKinds: r.Agent.RejectToolKinds}
	}
	if v.State == sandboxv1.RouteState_ROUTE_STATE_UNSPECIFIED {
		v.State = sandboxv1.RouteState_ROUTE_STATE_UNKNOWN
	}
	if !r.Updated.IsZero() {
		v.UpdateTime = timestamppb.New(r.Updated)
	}
	return v
}

func phaseProto(p allocation.Phase) sandboxv1.AllocationState {
	return map[allocation.Phase]sandboxv1.AllocationState{
		allocation.Stopped: sandboxv1.AllocationState_ALLOCATION_STATE_STOPPED, allocation.Creating: sandboxv1.AllocationState_ALLOCATION_STATE_CREATING,
		allocation.Starting: sandboxv1.AllocationState_ALLOCATION_STATE_STARTING, allocation.Connected: sandboxv1.AllocationState_ALLOCATION_STATE_CONNECTED,
		allocation.Disconnected: sandboxv1.AllocationState_ALLOCATION_STATE_DISCONNECTED, allocation.Stopping: sandboxv1.AllocationState_ALLOCATION_STATE_STOPPING,
	}[p]
}

func leaseProto(l lease.Lease) sandboxv1.LeaseState {
	switch {
	case l.State == lease.StopNeeded && l.Exhausted:
		return sandboxv1.LeaseState_LEASE_STATE_EXHAUSTED
	case l.State == lease.None:
		return sandboxv1.LeaseState_LEASE_STATE_NONE
	case l.State == lease.OwnsWrapper:
		return sandboxv1.LeaseState_LEASE_STATE_OWNS_WRAPPER
	case l.State == lease.StopNeeded:
		return sandboxv1.LeaseState_LEASE_STATE_STOP_NEEDED
	case l.State == lease.Stopping:
		return sandboxv1.LeaseState_LEASE_STATE_STOPPING
	}
	return sandboxv1.LeaseState_LEASE_STATE_UNSPECIFIED
}
