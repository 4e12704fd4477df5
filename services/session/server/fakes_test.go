package server

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
)

// Small fake peers behind real gRPC listeners, implementing the sandbox,
// credential and ingest contracts as far as the session service uses them.

func serveFake(t testing.TB, register func(*grpc.Server)) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	register(s)
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(lis) }()
	t.Cleanup(func() { s.Stop(); <-done })
	return lis.Addr().String()
}

type fakeSandbox struct {
	sandboxv1.UnimplementedSandboxServiceServer
	// readyOnPrepare makes Prepare answer READY (a warm route).
	readyOnPrepare atomic.Bool
	// inspectionFails makes ReleaseRoute report absence not verified.
	inspectionFails atomic.Bool
	// exhaustedLease makes ReleaseRoute report an exhausted lease after its
	// final observation (absence not verified, deletion allowed).
	exhaustedLease atomic.Bool
	// deliverNotReady makes Deliver answer NOT_READY.
	deliverNotReady atomic.Bool
	// prepareUnavailable makes Prepare answer UNAVAILABLE.
	prepareUnavailable atomic.Bool

	mu        sync.Mutex
	prepares  map[string]int
	delivered map[string][]string // session → message ids in delivery order
	aborts    map[string]int
	releases  map[string]int
	released  map[string]bool   // absence verified for the session
	tenants   map[string]string // sandbox → "org/user" that claimed it
}

func (f *fakeSandbox) CheckWorktree(context.Context, *sandboxv1.CheckWorktreeRequest) (*sandboxv1.CheckWorktreeResponse, error) {
	return &sandboxv1.CheckWorktreeResponse{}, nil
}

func newFakeSandbox() *fakeSandbox {
	return &fakeSandbox{prepares: map[string]int{}, delivered: map[string][]string{},
		aborts: map[string]int{}, releases: map[string]int{}, released: map[string]bool{}, tenants: map[string]string{}}
}

// ClaimSandbox binds like the sandbox service: the first tenant keeps it.
func (f *fakeSandbox) ClaimSandbox(_ context.Context, r *sandboxv1.ClaimSandboxRequest) (*sandboxv1.ClaimSandboxResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := r.GetTenant().GetOrgId() + "/" + r.GetTenant().GetUserId()
	if old, ok := f.tenants[r.GetSandboxId()]; ok && old != t {
		return nil, apierr.Error(codes.PermissionDenied, "SANDBOX_TENANT_MISMATCH", "the sandbox does not belong to this tenant")
	}
	f.tenants[r.GetSandboxId()] = t
	return &sandboxv1.ClaimSandboxResponse{}, nil
}

func (f *fakeSandbox) Prepare(_ context.Context, r *sandboxv1.PrepareRequest) (*sandboxv1.PrepareResponse, error) {
	f.mu.Lock()
	f.prepares[r.GetRoute().GetSessionId()]++
	f.mu.Unlock()
	if f.prepareUnavailable.Load() {
		return nil, status.Error(codes.Unavailable, "sandbox replica gone")
	}
	v := &sandboxv1.RouteView{SessionId: r.GetRoute().GetSessionId(), State: sandboxv1.RouteState_ROUTE_STATE_PREPARING, Step: "create_sandbox"}
	if f.readyOnPrepare.Load() {
		v = &sandboxv1.RouteView{SessionId: r.GetRoute().GetSessionId(), State: sandboxv1.RouteState_ROUTE_STATE_READY,
			RuntimeSessionId: "rt-" + r.GetRoute().GetSessionId(), WrapperInstance: "w1"}
	}
	return &sandboxv1.PrepareResponse{Route: v}, nil
}

func (f *fakeSandbox) Deliver(_ context.Context, r *sandboxv1.DeliverRequest) (*sandboxv1.DeliverResponse, error) {
	if f.deliverNotReady.Load() {
		return &sandboxv1.DeliverResponse{Result: sandboxv1.DeliveryResult_DELIVERY_RESULT_NOT_READY,
			Route: &sandboxv1.RouteView{State: sandboxv1.RouteState_ROUTE_STATE_PREPARING, Step: "launch_wrapper"}}, nil
	}
	f.mu.Lock()
	for _, m := range r.GetMessages() {
		f.delivered[r.GetSessionId()] = append(f.delivered[r.GetSessionId()], m.GetMessageId())
	}
	f.mu.Unlock()
	return &sandboxv1.DeliverResponse{Result: sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT}, nil
}

func (f *fakeSandbox) Abort(_ context.Context, r *sandboxv1.AbortRequest) (*sandboxv1.AbortResponse, error) {
	f.mu.Lock()
	f.aborts[r.GetSessionId()]++
	f.mu.Unlock()
	return &sandboxv1.AbortResponse{Sent: true}, nil
}

func (f *fakeSandbox) ReleaseRoute(_ context.Context, r *sandboxv1.ReleaseRouteRequest) (*sandboxv1.ReleaseRouteResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.releases[r.GetSessionId()]++
	if f.inspectionFails.Load() {
		// The provider could not inspect: a stop is requested, absence unknown.
		return &sandboxv1.ReleaseRouteResponse{LastMember: true, AbsenceVerified: false,
			LeaseState: sandboxv1.LeaseState_LEASE_STATE_STOP_NEEDED, RetryAfter: durationpb.New(20 * time.Millisecond)}, nil
	}
	if f.exhaustedLease.Load() {
		return &sandboxv1.ReleaseRouteResponse{LastMember: true, AbsenceVerified: false,
			LeaseState: sandboxv1.LeaseState_LEASE_STATE_EXHAUSTED, RetryAfter: durationpb.New(10 * time.Minute)}, nil
	}
	f.released[r.GetSessionId()] = true
	return &sandboxv1.ReleaseRouteResponse{LastMember: true, AbsenceVerified: true, LeaseState: sandboxv1.LeaseState_LEASE_STATE_NONE}, nil
}

func (f *fakeSandbox) count(m map[string]int, id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return m[id]
}

func (f *fakeSandbox) deliveredTo(id string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.delivered[id]...)
}

type fakeCredential struct {
	credentialv1.UnimplementedCredentialServiceServer
	mu       sync.Mutex
	secrets  map[string]string // ref → secret
	prefixes map[string]string // git ref → git_push_branch_prefix
}

func newFakeCredential() *fakeCredential {
	return &fakeCredential{secrets: map[string]string{}, prefixes: map[string]string{}}
}

func (f *fakeCredential) PutBackingCredential(_ context.Context, r *credentialv1.PutBackingCredentialRequest) (*credentialv1.PutBackingCredentialResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ref := "cref-" + r.GetSessionId()
	if r.GetRepoUrl() != "" {
		ref = "gref-" + r.GetSessionId() // a git credential (anonymous without a secret)
		f.prefixes[ref] = r.GetGitPushBranchPrefix()
	}
	f.secrets[ref] = r.GetSecret()
	return &credentialv1.PutBackingCredentialResponse{CredentialRef: ref}, nil
}

func (f *fakeCredential) DeleteBackingCredential(_ context.Context, r *credentialv1.DeleteBackingCredentialRequest) (*credentialv1.DeleteBackingCredentialResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.secrets, r.GetCredentialRef())
	return &credentialv1.DeleteBackingCredentialResponse{}, nil
}

func (f *fakeCredential) pushPrefix(ref string) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.prefixes[ref]
	return p, ok
}

func (f *fakeCredential) secret(ref string) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.secrets[ref]
	return s, ok
}

type fakeIngest struct {
	ingestv1.UnimplementedIngestServiceServer
	mu      sync.Mutex
	deleted map[string]bool
}

func (f *fakeIngest) Delete(_ context.Context, r *ingestv1.DeleteRequest) (*ingestv1.DeleteResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleted[r.GetRuntimeSessionId()] = true
	return &ingestv1.DeleteResponse{}, nil
}

func (f *fakeIngest) wasDeleted(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.deleted[id]
}
