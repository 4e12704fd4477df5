package server

import (
	"context"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/redistest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestLoadConfig(t *testing.T) {
	cfg, err := LoadConfig(nil, env(map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1"}))
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:7404", cfg.GRPCAddr)
	require.Equal(t, "127.0.0.1:9404", cfg.MetricsAddr)
	require.Equal(t, "127.0.0.1:7403", cfg.CredentialAddr)

	cfg, err = LoadConfig([]string{"--credential-addr", "cred:1"}, env(map[string]string{"AGENTPLANE_REDIS_URL": "redis://x:1"}))
	require.NoError(t, err)
	require.Equal(t, "cred:1", cfg.CredentialAddr)

	_, err = LoadConfig(nil, env(map[string]string{"AGENTPLANE_CREDENTIAL_ADDR": "nope"}))
	require.ErrorContains(t, err, "AGENTPLANE_REDIS_URL (--redis-url)")
	require.ErrorContains(t, err, "AGENTPLANE_CREDENTIAL_ADDR (--credential-addr)")
}

// memberCredential answers CheckScopeMember: only "rs-a" in (sbx, /w) is live. It records
// the authorization it was called with.
type memberCredential struct {
	credentialv1.UnimplementedCredentialServiceServer
	auth chan string
}

func (m *memberCredential) CheckScopeMember(ctx context.Context, req *credentialv1.CheckScopeMemberRequest) (*credentialv1.CheckScopeMemberResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	select {
	case m.auth <- md.Get("authorization")[0]:
	default:
	}
	live := req.GetScope().GetSandboxId() == "sbx" && req.GetScope().GetDirectory() == "/w" && req.GetRuntimeSessionId() == "rs-a"
	return &credentialv1.CheckScopeMemberResponse{Live: live}, nil
}

// TestRunServesAndDrains runs the whole service on real listeners: health, a v2-scoped
// ingest that asks a credential service over TCP with the internal token, and a clean stop.
func TestRunServesAndDrains(t *testing.T) {
	redisSrv := redistest.Start(t)

	credLis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	fake := &memberCredential{auth: make(chan string, 1)}
	credSrv := grpc.NewServer()
	credentialv1.RegisterCredentialServiceServer(credSrv, fake)
	go func() { _ = credSrv.Serve(credLis) }()
	defer credSrv.Stop()

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	cfg := DefaultConfig()
	cfg.RedisURL = redisSrv.URL()
	cfg.GRPCAddr = lis.Addr().String()
	cfg.MetricsAddr = ""
	cfg.DrainDelay = 0
	cfg.InternalToken = "tok"
	cfg.CredentialAddr = credLis.Addr().String()
	cfg.LogFormat = "text"
	require.NoError(t, cfg.Validate())

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- RunWith(ctx, cfg, Listeners{GRPC: lis}) }()

	conn, err := grpc.NewClient(cfg.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	health := healthpb.NewHealthClient(conn)
	require.Eventually(t, func() bool {
		r, err := health.Check(ctx, &healthpb.HealthCheckRequest{})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}, 30e9, 20e6)

	callCtx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer tok")
	client := ingestv1.NewIngestServiceClient(conn)
	scope := &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V2{V2: &ingestv1.ScopeV2{SandboxId: "sbx", Directory: "/w", ResolvingRuntimeSessionId: "rs-a", OrgId: "o1", UserId: "u1"}}}
	res, err := client.Ingest(callCtx, &ingestv1.IngestRequest{RuntimeSessionId: "rs-a", Scope: scope, Items: []*ingestv1.Item{
		{ItemId: "m1", Type: ingestv1.ItemType_ITEM_TYPE_MESSAGE, Version: 1, Payload: []byte(`{"text":"hello"}`)},
	}})
	require.NoError(t, err)
	require.Equal(t, int32(1), res.GetApplied())
	require.Equal(t, "Bearer tok", <-fake.auth)

	exp, err := client.Export(callCtx, &ingestv1.ExportRequest{RuntimeSessionId: "rs-a", Scope: scope})
	require.NoError(t, err)
	require.Len(t, exp.GetItems(), 1)

	cancel()
	require.NoError(t, <-done)
}
