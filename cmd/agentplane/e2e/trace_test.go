package e2e

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracev1 "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testaddr"
	"agentplane.dev/pkg/testenv"
)

// otlpReceiver is an in-process OTLP/gRPC trace collector keeping every span with the
// service.name of the process that sent it.
type otlpReceiver struct {
	collectortrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []recvSpan
}

type recvSpan struct {
	service string
	span    *tracev1.Span
}

func (r *otlpReceiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				r.spans = append(r.spans, recvSpan{service, s})
			}
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

func (r *otlpReceiver) trace(id []byte) []recvSpan {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []recvSpan
	for _, s := range r.spans {
		if string(s.span.GetTraceId()) == string(id) {
			out = append(out, s)
		}
	}
	return out
}

func startReceiver(t *testing.T) (*otlpReceiver, string) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	rec := &otlpReceiver{}
	collectortrace.RegisterTraceServiceServer(srv, rec)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return rec, lis.Addr().String()
}

// startProcess runs `agentplane serve <service>` as its own process with env; it is stopped
// (SIGTERM, so it flushes its spans) at cleanup.
func startProcess(t *testing.T, bin, service string, env []string) {
	cmd := exec.Command(bin, "serve", service)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	cmd.Stdout, cmd.Stderr = t.Output(), t.Output()
	require.NoError(t, cmd.Start(), service)
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
}

// TestOneTraceAcrossEveryHop runs the four services as separate processes exporting to an
// in-process OTLP receiver, sends one message under a known trace id through a real
// wrapper and the scripted runtime (which calls the provider and ingest routes through the
// proxy) behind the sandbox boundary, and follows the parent links from the ingest
// service's span back to the client: ingest ← proxy (credential) ← wrapper ← sandbox ← session ← client.
func TestOneTraceAcrossEveryHop(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "agentplane")
	build := exec.Command("go", "build", "-o", bin, "agentplane.dev/cmd/agentplane")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run(), "build agentplane")

	rec, otlpAddr := startReceiver(t)
	rs := redistest.Start(t)
	provider := httptest.NewServer(&upstream{})
	t.Cleanup(provider.Close)
	root := testenv.SandboxRoot(t)
	killProcessesUnder(t, root)
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	b64 := base64.StdEncoding.EncodeToString(key)
	ses, sbx, cred, ing, proxy := testaddr.Addr(t), testaddr.Addr(t), testaddr.Addr(t), testaddr.Addr(t), testaddr.Addr(t)
	common := []string{
		"AGENTPLANE_REDIS_URL=" + rs.URL(), "AGENTPLANE_INTERNAL_TOKEN=" + token, "AGENTPLANE_DRAIN_DELAY=0s",
		"AGENTPLANE_LOG_LEVEL=warn", "AGENTPLANE_METRICS_ADDR=",
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + otlpAddr, "OTEL_BSP_SCHEDULE_DELAY=100",
	}
	with := func(kv ...string) []string { return append(slices.Clone(common), kv...) }
	startProcess(t, bin, "ingest", with("AGENTPLANE_GRPC_ADDR="+ing, "AGENTPLANE_CREDENTIAL_ADDR="+cred))
	startProcess(t, bin, "credential", with("AGENTPLANE_GRPC_ADDR="+cred, "AGENTPLANE_PROXY_ADDR="+proxy,
		"AGENTPLANE_INGEST_ADDR="+ing, "AGENTPLANE_CREDENTIAL_KEY="+b64, "AGENTPLANE_ATTESTATION_KEY="+b64,
		"AGENTPLANE_PROVIDER_UPSTREAM="+provider.URL, "AGENTPLANE_SESSION_ADDR="+ses))
	startProcess(t, bin, "sandbox", with("AGENTPLANE_GRPC_ADDR="+sbx, "AGENTPLANE_SESSION_ADDR="+ses,
		"AGENTPLANE_CREDENTIAL_ADDR="+cred, "AGENTPLANE_SANDBOX_PROXY_URL=http://"+proxy,
		// Behind the boundary (the default) the wrapper's network is
		// loopback only: its spans leave through the sandbox service's OTLP relay.
		"AGENTPLANE_SANDBOX_ROOT="+root, "AGENTPLANE_WRAPPER_BIN="+wrapperBin))
	startProcess(t, bin, "session", with("AGENTPLANE_GRPC_ADDR="+ses, "AGENTPLANE_SANDBOX_ADDR="+sbx,
		"AGENTPLANE_CREDENTIAL_ADDR="+cred, "AGENTPLANE_INGEST_ADDR="+ing))

	conn, err := grpcclient.Dial(ses, token)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	s := &suite{ses: sessionv1.NewSessionServiceClient(conn), run: newRunID()}
	sess := s.create(t, "sbx-trace", "/work/e2e-trace", newSecret())

	// The client's span: a known trace id and span id, sent as W3C traceparent.
	traceID, clientSpan := make([]byte, 16), make([]byte, 8)
	_, _ = rand.Read(traceID)
	_, _ = rand.Read(clientSpan)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	tctx := metadata.AppendToOutgoingContext(ctx, "traceparent",
		fmt.Sprintf("00-%s-%s-01", hex.EncodeToString(traceID), hex.EncodeToString(clientSpan)))
	_, err = s.ses.SendMessage(tctx, &sessionv1.SendMessageRequest{SessionId: sess.GetSessionId(), MessageId: "m1", Content: "trace me"})
	require.NoError(t, err)
	watch, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sess.GetSessionId()})
	require.NoError(t, err)
	for {
		resp, err := watch.Recv()
		require.NoError(t, err)
		if o := resp.GetEvent().GetOutcome(); o != nil && o.GetLastMessageId() == "m1" {
			require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult())
			break
		}
	}

	// Every hop's spans arrive (batches flush every 100 ms); then follow the parents.
	want := []string{"agentplane-session", "agentplane-sandbox", "agentplane-wrapper", "agentplane-credential", "agentplane-ingest"}
	var chain []string
	require.Eventually(t, func() bool {
		spans := rec.trace(traceID)
		byID := map[string]recvSpan{}
		for _, sp := range spans {
			byID[string(sp.span.GetSpanId())] = sp
		}
		for _, leaf := range spans {
			if leaf.service != "agentplane-ingest" || leaf.span.GetKind() != tracev1.Span_SPAN_KIND_SERVER {
				continue
			}
			// Walk up: the services met, in order from the client, each once.
			chain = chain[:0]
			cur, ok := leaf, true
			for ok {
				if len(chain) == 0 || chain[0] != cur.service {
					chain = append([]string{cur.service}, chain...)
				}
				parent := string(cur.span.GetParentSpanId())
				if parent == string(clientSpan) {
					if slices.Equal(chain, want) {
						return true
					}
					break
				}
				cur, ok = byID[parent]
			}
		}
		return false
	}, 60*time.Second, 200*time.Millisecond, "no span chain client → %v; last chain %v", want, chain)

	// The proxy's span names the route only (no sandbox id, no handle).
	for _, sp := range rec.trace(traceID) {
		if sp.service == "agentplane-credential" && sp.span.GetKind() == tracev1.Span_SPAN_KIND_SERVER {
			require.NotContains(t, sp.span.GetName(), "sbx-trace")
		}
	}
}
