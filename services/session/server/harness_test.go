package server

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testclock"
	"agentplane.dev/services/session/internal/service"
)

const testToken = "internal-test-token"

type env struct {
	t       testing.TB
	ctx     context.Context
	rdb     *redis.Client
	redis   *redistest.Server
	sandbox *fakeSandbox
	creds   *fakeCredential
	ingest  *fakeIngest
	clock   *testclock.Clock
	svc     *service.Service
	api     sessionv1.SessionServiceClient
	notify  sessionv1.SessionNotifyServiceClient
	logs    *logtest.Buffer
}

type envOpt func(*Config)

// fastReconcile runs the reconciler often with tiny backoffs.
func fastReconcile(c *Config) {
	c.ReconcileInterval = 10 * time.Millisecond
	c.DeleteBackoffBase = 10 * time.Millisecond
	c.DeleteBackoffMax = 50 * time.Millisecond
}

func newEnv(t testing.TB, opts ...envOpt) *env {
	t.Helper()
	rs := redistest.Start(t)
	e := &env{t: t, rdb: rs.Client(t), redis: rs, sandbox: newFakeSandbox(), creds: newFakeCredential(),
		ingest: &fakeIngest{deleted: map[string]bool{}},
		clock:  testclock.New(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)), logs: &logtest.Buffer{}}
	cfg := DefaultConfig()
	cfg.RedisURL = "redis://" + rs.Addr()
	cfg.MetricsAddr = ""
	cfg.InternalToken = testToken
	cfg.DrainDelay = 0
	cfg.ShutdownTimeout = 5 * time.Second
	cfg.SweepInterval = time.Hour // tests call Sweep themselves with the fake clock
	cfg.WatchBlock = 200 * time.Millisecond
	cfg.WatchPoolSize = 256
	cfg.LogLevel = -4
	cfg.SandboxAddr = serveFake(t, func(s *grpc.Server) { sandboxv1.RegisterSandboxServiceServer(s, e.sandbox) })
	cfg.CredentialAddr = serveFake(t, func(s *grpc.Server) { credentialv1.RegisterCredentialServiceServer(s, e.creds) })
	cfg.IngestAddr = serveFake(t, func(s *grpc.Server) { ingestv1.RegisterIngestServiceServer(s, e.ingest) })
	for _, o := range opts {
		o(&cfg)
	}
	require.NoError(t, cfg.Validate())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan *service.Service, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, cfg, Listeners{GRPC: lis}, hooks{now: e.clock.Now, started: func(s *service.Service) { started <- s },
			logOutput: e.logs})
	}()
	select {
	case e.svc = <-started:
	case err := <-done:
		t.Fatalf("server did not start: %v", err)
	}
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = conn.Close()
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("server: %v", err)
		}
	})
	e.ctx = metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+testToken)
	e.api = sessionv1.NewSessionServiceClient(conn)
	e.notify = sessionv1.NewSessionNotifyServiceClient(conn)
	return e
}

// eventually polls cond with a generous bound (no wall-clock assertion: the
// bound only stops a hung test).
func eventually(t testing.TB, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (e *env) create(id, user, dir string) *sessionv1.Session {
	e.t.Helper()
	resp, err := e.api.CreateSession(e.ctx, &sessionv1.CreateSessionRequest{
		SessionId: id, UserId: user, OrgId: "org1",
		Worktree:   &sessionv1.Worktree{Directory: dir, RepoUrl: "https://example.com/r.git"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-SECRET-" + id},
	})
	require.NoError(e.t, err)
	return resp.GetSession()
}

func (e *env) send(sid, mid, content string) *sessionv1.Message {
	e.t.Helper()
	resp, err := e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: sid, MessageId: mid, Content: content})
	require.NoError(e.t, err)
	return resp.GetMessage()
}

func (e *env) message(sid, mid string) *sessionv1.Message {
	e.t.Helper()
	resp, err := e.api.GetMessage(e.ctx, &sessionv1.GetMessageRequest{SessionId: sid, MessageId: mid})
	require.NoError(e.t, err)
	return resp.GetMessage()
}

func (e *env) waitState(sid, mid string, st sessionv1.MessageState) *sessionv1.Message {
	e.t.Helper()
	var m *sessionv1.Message
	eventually(e.t, func() bool { m = e.message(sid, mid); return m.GetState() == st }, "message "+mid+" "+st.String())
	return m
}

func (e *env) route(sid string, token uint64) *sessionv1.RouteRef {
	return &sessionv1.RouteRef{SessionId: sid, SandboxId: "", FenceToken: token}
}

func (e *env) ready(sid, instance string) {
	e.t.Helper()
	_, err := e.notify.NotifyRouteReady(e.ctx, &sessionv1.NotifyRouteReadyRequest{
		Route: e.route(sid, 1), RuntimeSessionId: "rt-" + sid, WrapperInstance: instance})
	require.NoError(e.t, err)
}
