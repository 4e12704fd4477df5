package grpcapi_test

import (
	"context"
	"net"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/ingest/internal/grpcapi"
	"agentplane.dev/services/ingest/internal/membership"
	"agentplane.dev/services/ingest/internal/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const internalToken = "test-internal-token"

// fakeCredential is a CredentialService that answers CheckScopeMember from a member list.
type fakeCredential struct {
	credentialv1.UnimplementedCredentialServiceServer
	mu      sync.Mutex
	live    map[[3]string]bool // sandbox, directory, runtime session id
	calls   int
	failing bool
	tokens  []string // authorization metadata seen
}

func (f *fakeCredential) join(sandbox, dir, rs string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.live[[3]string{sandbox, dir, rs}] = true
}

func (f *fakeCredential) leave(sandbox, dir, rs string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.live, [3]string{sandbox, dir, rs})
}

func (f *fakeCredential) CheckScopeMember(ctx context.Context, req *credentialv1.CheckScopeMemberRequest) (*credentialv1.CheckScopeMemberResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	md, _ := metadata.FromIncomingContext(ctx)
	f.tokens = append(f.tokens, md.Get("authorization")...)
	if f.failing {
		return nil, context.DeadlineExceeded
	}
	// Every live member is tenant o1/u1's.
	live := f.live[[3]string{req.GetScope().GetSandboxId(), req.GetScope().GetDirectory(), req.GetRuntimeSessionId()}] &&
		req.GetOrgId() == "o1" && req.GetUserId() == "u1"
	return &credentialv1.CheckScopeMemberResponse{Live: live}, nil
}

type harness struct {
	client     ingestv1.IngestServiceClient
	anonymous  ingestv1.IngestServiceClient // sends no internal token
	rdb        redis.UniversalClient
	credential *fakeCredential
	store      *store.Store
	redis      *redistest.Server
}

// start runs the ingest service over bufconn on a real grpcserver (with internal auth) in
// front of a private redis-server, asking a fake credential service over gRPC.
func start(t *testing.T) *harness {
	t.Helper()
	redisSrv := redistest.Start(t)
	rdb := redisSrv.Client(t)

	// The fake credential service, on its own gRPC server.
	fake := &fakeCredential{live: map[[3]string]bool{}}
	credLis := bufconn.Listen(1 << 20)
	credSrv := grpc.NewServer()
	credentialv1.RegisterCredentialServiceServer(credSrv, fake)
	go func() { _ = credSrv.Serve(credLis) }()
	t.Cleanup(credSrv.Stop)
	credConn, err := grpc.NewClient("passthrough:///credential",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return credLis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+internalToken), method, req, reply, cc, opts...)
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = credConn.Close() })

	// The ingest service.
	lis := bufconn.Listen(16 << 20)
	// The server closes its Redis client at shutdown; give it its own.
	serverRedis := redis.NewClient(redisSrv.Options())
	srv, err := grpcserver.New(grpcserver.Options{
		Name: "ingest", Logger: logtest.New(t), Redis: serverRedis, Listener: lis, InternalToken: internalToken,
	})
	require.NoError(t, err)
	st := store.New(serverRedis)
	st.TailBlock = 50e6 // 50ms: tombstones and cancellations are noticed quickly
	grpcapi.New(st, membership.New(credConn), logtest.New(t)).Register(srv)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-served)
	})

	conn, err := grpc.NewClient("passthrough:///ingest",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(16<<20)),
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+internalToken), method, req, reply, cc, opts...)
		}),
		grpc.WithStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+internalToken), desc, cc, method, opts...)
		}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	anon, err := grpc.NewClient("passthrough:///ingest",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = anon.Close() })
	return &harness{client: ingestv1.NewIngestServiceClient(conn), anonymous: ingestv1.NewIngestServiceClient(anon), rdb: rdb, credential: fake, store: st, redis: redisSrv}
}
