package grpcclient

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"agentplane.dev/pkg/apierr"
)

const reasonElsewhere = "THING_OWNED_ELSEWHERE"

// replica answers Check for the entities it owns (HealthCheckRequest.Service
// is the entity) and names the owner of the others.
type replica struct {
	healthpb.UnimplementedHealthServer
	addr  string
	srv   *grpc.Server
	mu    sync.Mutex
	owns  map[string]bool
	owner map[string]string // entity → owner address to name
	calls int
}

func startReplica(t *testing.T) *replica {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := &replica{addr: lis.Addr().String(), srv: grpc.NewServer(), owns: map[string]bool{}, owner: map[string]string{}}
	healthpb.RegisterHealthServer(r.srv, r)
	go func() { _ = r.srv.Serve(lis) }()
	t.Cleanup(r.srv.Stop)
	return r
}

func (r *replica) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	if r.owns[req.GetService()] {
		return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
	}
	var opts []apierr.Option
	if a := r.owner[req.GetService()]; a != "" {
		opts = append(opts, apierr.Metadata(apierr.MetaOwnerAddr, a))
	}
	return nil, apierr.Error(codes.Unavailable, reasonElsewhere, "owned elsewhere", opts...)
}

func (r *replica) set(entity string, owns bool, owner string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.owns[entity], r.owner[entity] = owns, owner
}

func (r *replica) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls
}

func entityKey(req any) string {
	if r, ok := req.(*healthpb.HealthCheckRequest); ok {
		return r.GetService()
	}
	return ""
}

// A call that reaches a non-owner follows the owner it names, once; the
// next call goes to the owner directly; when the owner dies the router
// asks through the balancer again and learns the new owner.
func TestOwnerRouterFollowsTheNamedOwner(t *testing.T) {
	a, b := startReplica(t), startReplica(t)
	a.set("x", true, "")
	b.set("x", false, a.addr)

	conns := NewConns("")
	t.Cleanup(conns.Close)
	router := NewOwnerRouter(conns, reasonElsewhere, entityKey)
	conn, err := conns.Dial(b.addr, router.DialOption()) // the "balancer" only ever picks B
	require.NoError(t, err)
	hc := healthpb.NewHealthClient(conn)
	check := func(entity string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: entity})
		return err
	}

	require.NoError(t, check("x"))
	require.Equal(t, 1, b.count(), "the first call reached the non-owner")
	require.Equal(t, 1, a.count(), "and was sent once to the owner it named")
	require.Equal(t, a.addr, router.Owner("x"))

	require.NoError(t, check("x"))
	require.Equal(t, 1, b.count(), "the next call went to the owner directly")
	require.Equal(t, 2, a.count())

	// A call about no entity and an owner that names nobody: one attempt.
	b.set("y", false, "")
	err = check("y")
	require.Equal(t, reasonElsewhere, apierr.Reason(err))
	require.Equal(t, 2, b.count())

	// The owner dies; B takes x over.
	a.srv.Stop()
	b.set("x", true, "")
	require.NoError(t, check("x"))
	require.Equal(t, 3, b.count())
	require.Empty(t, router.Owner("x"), "a dead owner is forgotten")
}

// A named owner that names yet another owner is not followed further: at
// most one redirect per call.
func TestOwnerRouterRedirectsOnce(t *testing.T) {
	a, b, c := startReplica(t), startReplica(t), startReplica(t)
	b.set("x", false, a.addr)
	a.set("x", false, c.addr)
	c.set("x", true, "")
	conns := NewConns("")
	t.Cleanup(conns.Close)
	router := NewOwnerRouter(conns, reasonElsewhere, entityKey)
	conn, err := conns.Dial(b.addr, router.DialOption())
	require.NoError(t, err)
	_, err = healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{Service: "x"})
	require.Equal(t, reasonElsewhere, apierr.Reason(err))
	require.Equal(t, 0, c.count())
	require.Equal(t, 1, a.count())
}
