package grpcserver_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/pkg/logging"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/pkg/redistest"
)

func TestMain(m *testing.M) {
	srv, stop := redistest.StartMain()
	redisSrv = srv
	code := m.Run()
	stop()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

var redisSrv *redistest.Server

// echoRequest is the test service's request message.
type echoRequest struct{ *wrapperspb.StringValue }

// testService is a hand-written service so these tests need no generated code.
type testService struct{ blocking chan struct{} }

func unary(name string, h func(ctx context.Context, s *testService, req echoRequest) (any, error)) grpc.MethodDesc {
	return grpc.MethodDesc{
		MethodName: name,
		Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := &echoRequest{&wrapperspb.StringValue{}} // decoded into and passed on, as generated code does
			if err := dec(req); err != nil {
				return nil, err
			}
			call := func(ctx context.Context, r any) (any, error) { return h(ctx, srv.(*testService), *r.(*echoRequest)) }
			return icpt(ctx, req, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/test.Echo/" + name}, call)
		},
	}
}

var testDesc = grpc.ServiceDesc{
	ServiceName: "test.Echo",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{
		unary("Echo", func(_ context.Context, _ *testService, r echoRequest) (any, error) {
			return wrapperspb.String(r.GetValue()), nil
		}),
		unary("Panic", func(context.Context, *testService, echoRequest) (any, error) {
			panic("secret internal state: password=hunter2")
		}),
		unary("Exempt", func(_ context.Context, _ *testService, r echoRequest) (any, error) {
			return wrapperspb.String(r.GetValue()), nil
		}),
		unary("Block", func(ctx context.Context, s *testService, _ echoRequest) (any, error) {
			close(s.blocking)
			<-ctx.Done() // only a hard stop ends this call
			return nil, ctx.Err()
		}),
	},
}

type harness struct {
	srv     *grpcserver.Server
	conn    *grpc.ClientConn
	rdb     redis.UniversalClient
	metrics string // http://host:port/metrics
	svc     *testService
	logs    *logtest.Buffer
	done    chan error
	cancel  context.CancelFunc
}

// start runs a server on real loopback listeners against the package's redis-server.
func start(t *testing.T, mutate func(*grpcserver.Options)) *harness {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	mlis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	rdb, err := config.Redis(redisSrv.URL())
	require.NoError(t, err)

	h := &harness{rdb: rdb, svc: &testService{blocking: make(chan struct{})}, logs: &logtest.Buffer{}, done: make(chan error, 1)}
	h.metrics = "http://" + mlis.Addr().String() + "/metrics"
	// Logs go to the test output and to a buffer the tests can search.
	logger := slog.New(logging.WithTraceIDs(slog.NewTextHandler(io.MultiWriter(h.logs, t.Output()), &slog.HandlerOptions{Level: slog.LevelDebug})))
	opts := grpcserver.Options{
		Name:            "test",
		Logger:          logger,
		Redis:           rdb,
		Listener:        lis,
		MetricsListener: mlis,
		HealthInterval:  20 * time.Millisecond,
		ShutdownTimeout: time.Minute, // generous: tests that want a hard stop lower it
	}
	if mutate != nil {
		mutate(&opts)
	}
	h.srv, err = grpcserver.New(opts)
	require.NoError(t, err)
	h.srv.RegisterService(&testDesc, h.svc)

	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- h.srv.Serve(ctx) }()

	h.conn, err = grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { h.stop(t) })
	return h
}

// stop ends Serve and waits for it; idempotent.
func (h *harness) stop(t *testing.T) {
	t.Helper()
	if h.cancel == nil {
		return
	}
	_ = h.conn.Close() // an open client stream would otherwise hold GracefulStop
	h.cancel()
	h.cancel = nil
	require.NoError(t, <-h.done)
	http.DefaultClient.CloseIdleConnections()
}

func (h *harness) call(ctx context.Context, method, value string) (string, error) {
	out := &wrapperspb.StringValue{}
	err := h.conn.Invoke(ctx, "/test.Echo/"+method, wrapperspb.String(value), out)
	return out.GetValue(), err
}

// waitStatus watches service until it reports want.
func (h *harness) waitStatus(t *testing.T, service string, want healthpb.HealthCheckResponse_ServingStatus) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second) // a liveness bound, not a timing assertion
	defer cancel()
	w, err := healthpb.NewHealthClient(h.conn).Watch(ctx, &healthpb.HealthCheckRequest{Service: service})
	require.NoError(t, err)
	for {
		resp, err := w.Recv()
		require.NoError(t, err, "waiting for %q to become %v", service, want)
		if resp.GetStatus() == want {
			return
		}
	}
}

func (h *harness) check(t *testing.T, service string) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	resp, err := healthpb.NewHealthClient(h.conn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: service})
	require.NoError(t, err)
	return resp.GetStatus()
}

func TestPanicBecomesInternalWithoutItsText(t *testing.T) {
	h := start(t, nil)
	_, err := h.call(t.Context(), "Panic", "x")

	st := status.Convert(err)
	require.Equal(t, codes.Internal, st.Code())
	require.Equal(t, "internal error", st.Message())
	require.Equal(t, grpcserver.ReasonInternal, apierr.Reason(err))
	wire, err := proto.Marshal(st.Proto()) // nothing of the panic anywhere in the status
	require.NoError(t, err)
	require.NotContains(t, string(wire), "hunter2")
	require.NotContains(t, string(wire), "secret")

	// The panic and its stack are in the server log, and the server keeps serving.
	require.Contains(t, h.logs.String(), "password=hunter2")
	require.Contains(t, h.logs.String(), "stack=")
	got, err := h.call(t.Context(), "Echo", "still up")
	require.NoError(t, err)
	require.Equal(t, "still up", got)
}

func TestHealthFollowsRedis(t *testing.T) {
	own := redistest.Start(t) // its own redis-server: this test kills it
	h := start(t, func(o *grpcserver.Options) {
		rdb, err := config.Redis(own.URL())
		require.NoError(t, err)
		o.Redis = rdb
	})

	h.waitStatus(t, "", healthpb.HealthCheckResponse_SERVING)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, h.check(t, "test.Echo"), "registered services mirror readiness")
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, h.check(t, grpcserver.LivenessService))

	require.NoError(t, own.Kill())
	h.waitStatus(t, "", healthpb.HealthCheckResponse_NOT_SERVING)
	h.waitStatus(t, "test.Echo", healthpb.HealthCheckResponse_NOT_SERVING)
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, h.check(t, grpcserver.LivenessService), "liveness does not depend on Redis")

	own.Start(t)
	h.waitStatus(t, "", healthpb.HealthCheckResponse_SERVING)
	h.waitStatus(t, "test.Echo", healthpb.HealthCheckResponse_SERVING)
}

func TestAuth(t *testing.T) {
	h := start(t, func(o *grpcserver.Options) {
		o.InternalToken = "s3cret-token"
		o.AuthExempt = func(m string) bool { return m == "/test.Echo/Exempt" }
	})
	withToken := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+tok)
	}

	_, err := h.call(t.Context(), "Echo", "x")
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	require.Equal(t, grpcserver.ReasonMissingCredentials, apierr.Reason(err))

	_, err = h.call(withToken("wrong"), "Echo", "x")
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	require.Equal(t, grpcserver.ReasonInvalidCredentials, apierr.Reason(err))

	_, err = h.call(withToken("s3cret-token"), "Echo", "x")
	require.NoError(t, err)

	_, err = h.call(t.Context(), "Exempt", "x")
	require.NoError(t, err, "an exempt method authenticates its callers itself")

	// Health needs no token (probes carry none); reflection lists the internal services,
	// so it does.
	h.waitStatus(t, "", healthpb.HealthCheckResponse_SERVING)
	rc, err := reflectionpb.NewServerReflectionClient(h.conn).ServerReflectionInfo(t.Context())
	require.NoError(t, err)
	_, err = rc.Recv()
	require.Equal(t, codes.Unauthenticated, status.Code(err), "reflection without the token")
	require.Equal(t, grpcserver.ReasonMissingCredentials, apierr.Reason(err))
	rc, err = reflectionpb.NewServerReflectionClient(h.conn).ServerReflectionInfo(withToken("wrong"))
	require.NoError(t, err)
	_, err = rc.Recv()
	require.Equal(t, grpcserver.ReasonInvalidCredentials, apierr.Reason(err))
	rc, err = reflectionpb.NewServerReflectionClient(h.conn).ServerReflectionInfo(withToken("s3cret-token"))
	require.NoError(t, err)
	names := listServices(t, rc)
	require.Contains(t, names, "test.Echo")
	require.Contains(t, names, "grpc.health.v1.Health")
	require.NoError(t, rc.CloseSend())
	_, err = rc.Recv()
	require.ErrorIs(t, err, io.EOF)

	// Rejected calls are still logged; health checks are not.
	require.Contains(t, h.logs.String(), "grpc.code=Unauthenticated")
	require.NotContains(t, h.logs.String(), "grpc.health.v1")
}

func TestShutdownOrder(t *testing.T) {
	var (
		mu    sync.Mutex
		steps []grpcserver.ShutdownStep
		h     *harness
	)
	seen := map[grpcserver.ShutdownStep]healthpb.HealthCheckResponse_ServingStatus{}
	h = start(t, func(o *grpcserver.Options) {
		o.DrainDelay = time.Millisecond
		o.OnShutdownStep = func(s grpcserver.ShutdownStep) {
			mu.Lock()
			steps = append(steps, s)
			mu.Unlock()
			if s == grpcserver.StepDrain {
				// Still accepting calls while draining, but reporting NOT_SERVING everywhere.
				seen[s] = h.check(t, "")
				seen["liveness@drain"] = h.check(t, grpcserver.LivenessService)
				seen["echo@drain"] = h.check(t, "test.Echo")
			}
		}
	})
	h.waitStatus(t, "", healthpb.HealthCheckResponse_SERVING)
	_, err := h.call(t.Context(), "Echo", "x")
	require.NoError(t, err)

	resp, err := http.Get(h.metrics)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.Contains(t, string(body), `grpc_server_handled_total{grpc_code="OK",grpc_method="Echo"`)

	// Shut down with the client still connected, so the drain-step checks can run.
	h.cancel()
	require.NoError(t, <-h.done)
	h.cancel = nil
	_ = h.conn.Close()
	http.DefaultClient.CloseIdleConnections()

	require.Equal(t, []grpcserver.ShutdownStep{
		grpcserver.StepNotServing, grpcserver.StepDrain, grpcserver.StepGracefulStop,
		grpcserver.StepCloseRedis, grpcserver.StepFlushTelemetry, grpcserver.StepStopMetrics,
	}, steps)
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, seen[grpcserver.StepDrain])
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, seen["liveness@drain"])
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, seen["echo@drain"])

	require.ErrorIs(t, h.rdb.Ping(context.Background()).Err(), redis.ErrClosed, "redis is closed")
	resp, err = http.Get(h.metrics)
	require.Error(t, err, "metrics server is stopped")
	require.Nil(t, resp)
}

func TestShutdownHardStopsAfterBound(t *testing.T) {
	var steps []grpcserver.ShutdownStep
	h := start(t, func(o *grpcserver.Options) {
		o.ShutdownTimeout = 10 * time.Millisecond
		o.OnShutdownStep = func(s grpcserver.ShutdownStep) { steps = append(steps, s) }
	})
	callErr := make(chan error, 1)
	go func() { _, err := h.call(context.Background(), "Block", "x"); callErr <- err }()
	<-h.svc.blocking // the call is in flight and will not finish by itself

	h.cancel()
	require.NoError(t, <-h.done)
	h.cancel = nil
	require.Error(t, <-callErr)
	_ = h.conn.Close()

	require.Equal(t, []grpcserver.ShutdownStep{
		grpcserver.StepNotServing, grpcserver.StepDrain, grpcserver.StepGracefulStop, grpcserver.StepHardStop,
		grpcserver.StepCloseRedis, grpcserver.StepFlushTelemetry, grpcserver.StepStopMetrics,
	}, steps)
}

func TestNewRejectsMissingOptions(t *testing.T) {
	_, err := grpcserver.New(grpcserver.Options{Addr: ":0", Logger: logtest.New(t)})
	require.ErrorContains(t, err, "Redis")
	_, err = grpcserver.New(grpcserver.Options{Addr: ":0"})
	require.ErrorContains(t, err, "Logger")
}

func TestLogLinesCarryTheCallersTraceID(t *testing.T) {
	h := start(t, nil)
	const traceID = "0af7651916cd43dd8448eb211c80319c"
	ctx := metadata.AppendToOutgoingContext(t.Context(), "traceparent", "00-"+traceID+"-b7ad6b7169203331-01")
	_, err := h.call(ctx, "Echo", "x")
	require.NoError(t, err)
	_, err = h.call(ctx, "Panic", "x")
	require.Error(t, err)
	h.stop(t) // Serve returns only after every line is written

	var lines []string
	for line := range strings.SplitSeq(h.logs.String(), "\n") {
		if strings.Contains(line, "grpc.method=Echo") || strings.Contains(line, "panic in gRPC handler") {
			lines = append(lines, line)
		}
	}
	require.Len(t, lines, 2)
	for _, line := range lines {
		require.Contains(t, line, "trace_id="+traceID)
		require.Contains(t, line, "span_id=")
	}
}

// Background work started with Go ends at the close_redis step, after the
// last call, and its last Redis write lands before Redis closes; a Serve
// that fails before any shutdown ends it too.
func TestBackgroundWorkEndsBeforeRedisCloses(t *testing.T) {
	var (
		mu    sync.Mutex
		steps []grpcserver.ShutdownStep
	)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	rdb, err := config.Redis(redisSrv.URL())
	require.NoError(t, err)
	srv, err := grpcserver.New(grpcserver.Options{Name: "bg", Logger: logtest.New(t), Redis: rdb, Listener: lis,
		OnShutdownStep: func(s grpcserver.ShutdownStep) {
			mu.Lock()
			steps = append(steps, s)
			mu.Unlock()
		}})
	require.NoError(t, err)
	var lastWrite error
	var stepsAtEnd []grpcserver.ShutdownStep
	srv.Go(func(ctx context.Context) {
		<-ctx.Done()
		mu.Lock()
		stepsAtEnd = slices.Clone(steps)
		mu.Unlock()
		lastWrite = rdb.Set(context.Background(), "bg:last", "written", 0).Err()
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, grpcserver.StepCloseRedis, stepsAtEnd[len(stepsAtEnd)-1], "ended at close_redis, not before")
	require.Contains(t, stepsAtEnd, grpcserver.StepGracefulStop)
	require.NoError(t, lastWrite, "the last write lands before Redis closes")

	failing, err := grpcserver.New(grpcserver.Options{Name: "fail", Logger: logtest.New(t), Redis: rdb, Addr: "127.0.0.1:-1"})
	require.NoError(t, err)
	ended := make(chan struct{})
	failing.Go(func(ctx context.Context) { <-ctx.Done(); close(ended) })
	require.Error(t, failing.Serve(context.Background()))
	select {
	case <-ended:
	default:
		t.Fatal("Serve returned before its background work ended")
	}
}

// rawCodec sends and receives message bytes as they are, so a test can send
// what no generated client would.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return "proto" }

// Malformed request bytes: field 1 (a proto3 string) with invalid UTF-8,
// and a length that runs past the end of the message.
var malformed = map[string][]byte{
	"invalid utf-8": {0x0a, 0x02, 0xff, 0xfe},
	"truncated":     {0x0a, 0x05, 'a'},
}

// A request that does not decode is INVALID_ARGUMENT with MALFORMED_REQUEST, after auth,
// and counted and logged like any other call (grpc-go alone answers INTERNAL before any
// interceptor).
func TestMalformedRequests(t *testing.T) {
	h := start(t, func(o *grpcserver.Options) { o.InternalToken = "tok" })
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer tok")
	h.waitStatus(t, "", healthpb.HealthCheckResponse_SERVING)
	for name, body := range malformed {
		for _, method := range []string{"/test.Echo/Echo", "/grpc.health.v1.Health/Check"} {
			var out []byte
			err := h.conn.Invoke(ctx, method, &body, &out, grpc.ForceCodecV2(rawCodec{}))
			require.Equal(t, codes.InvalidArgument, status.Code(err), "%s %s: %v", name, method, err)
			require.Equal(t, grpcserver.ReasonMalformedRequest, apierr.Reason(err), "%s %s", name, method)
		}
		// Health Watch is a server stream: its request is decoded inside the interceptors.
		st, err := h.conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, "/grpc.health.v1.Health/Watch", grpc.ForceCodecV2(rawCodec{}))
		require.NoError(t, err)
		require.NoError(t, st.SendMsg(&body))
		require.NoError(t, st.CloseSend())
		var out []byte
		err = st.RecvMsg(&out)
		require.Equal(t, grpcserver.ReasonMalformedRequest, apierr.Reason(err), name)
	}
	// Without the token the caller learns nothing else.
	body := malformed["truncated"]
	var out []byte
	err := h.conn.Invoke(t.Context(), "/test.Echo/Echo", &body, &out, grpc.ForceCodecV2(rawCodec{}))
	require.Equal(t, grpcserver.ReasonMissingCredentials, apierr.Reason(err))
	// The handler still serves good requests.
	got, err := h.call(ctx, "Echo", "fine")
	require.NoError(t, err)
	require.Equal(t, "fine", got)

	resp, err := http.Get(h.metrics)
	require.NoError(t, err)
	defer resp.Body.Close()
	metrics, _ := io.ReadAll(resp.Body)
	require.Contains(t, string(metrics), `grpc_server_handled_total{grpc_code="InvalidArgument",grpc_method="Echo",grpc_service="test.Echo",grpc_type="unary"} 2`)
	require.Contains(t, string(metrics), `grpc_server_handled_total{grpc_code="InvalidArgument",grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} 2`)
	require.Contains(t, h.logs.String(), "grpc.code=InvalidArgument")
}

// An unlisted service is served but not listed by reflection: the services'
// calls to each other sit beside a public service on one port, and nobody
// browsing the port should find them (a call still needs the token).
func TestUnlistedServicesAreServedNotListed(t *testing.T) {
	h := start(t, func(o *grpcserver.Options) { o.Unlisted = []string{"test.Echo"} })
	h.waitStatus(t, "", healthpb.HealthCheckResponse_SERVING)
	_, err := h.call(t.Context(), "Echo", "x")
	require.NoError(t, err, "served")
	rc, err := reflectionpb.NewServerReflectionClient(h.conn).ServerReflectionInfo(t.Context())
	require.NoError(t, err)
	names := listServices(t, rc)
	require.Contains(t, names, "grpc.health.v1.Health")
	require.NotContains(t, names, "test.Echo")
	require.NoError(t, rc.CloseSend())
}

// listServices asks a reflection stream for the services it lists.
func listServices(t *testing.T, rc reflectionpb.ServerReflection_ServerReflectionInfoClient) []string {
	t.Helper()
	require.NoError(t, rc.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
	resp, err := rc.Recv()
	require.NoError(t, err)
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	return names
}
