package telemetry_test

import (
	"context"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"

	"agentplane.dev/pkg/telemetry"
)

func clearEnv(t *testing.T) {
	for _, k := range []string{"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
		"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"} {
		t.Setenv(k, "")
	}
}

func TestDevDefaultExportsNothingButPropagates(t *testing.T) {
	clearEnv(t)
	p, err := telemetry.Setup(t.Context(), "test")
	require.NoError(t, err)
	require.False(t, p.Exporting())
	require.NoError(t, p.Shutdown(t.Context()))

	// W3C trace context goes in and out.
	const tp = "00-0102030405060708090a0b0c0d0e0f10-0102030405060708-01"
	ctx := otel.GetTextMapPropagator().Extract(context.Background(), propagation.MapCarrier{"traceparent": tp})
	out := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, out)
	require.Equal(t, tp, out["traceparent"])
}

func TestOTLPWhenEndpointSet(t *testing.T) {
	clearEnv(t)
	// A local listener that is never served: no span is created, so nothing is sent.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+ln.Addr().String())

	p, err := telemetry.Setup(t.Context(), "test")
	require.NoError(t, err)
	require.True(t, p.Exporting())
	require.NoError(t, p.Shutdown(t.Context()))
}

func TestBadEnvFailsFast(t *testing.T) {
	clearEnv(t)
	t.Setenv("OTEL_TRACES_EXPORTER", "zipkin")
	_, err := telemetry.Setup(t.Context(), "test")
	require.ErrorContains(t, err, "OTEL_TRACES_EXPORTER")

	clearEnv(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	_, err = telemetry.Setup(t.Context(), "test")
	require.ErrorContains(t, err, "OTEL_EXPORTER_OTLP_PROTOCOL")
}

// spanSink is an OTLP trace collector that counts the spans it receives.
type spanSink struct {
	collectortrace.UnimplementedTraceServiceServer
	spans atomic.Int64
}

func (s *spanSink) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			s.spans.Add(int64(len(ss.GetSpans())))
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

// TestWithDialerNeverResolvesTheEndpoint: behind the boundary the endpoint's
// name means nothing (no DNS, no route); the spans go over the dialer's
// connection (a Unix socket here, as the sandbox relay's is) all the same.
func TestWithDialerNeverResolvesTheEndpoint(t *testing.T) {
	clearEnv(t)
	sock := filepath.Join(t.TempDir(), "otlp.sock")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	srv := grpc.NewServer()
	sink := &spanSink{}
	collectortrace.RegisterTraceServiceServer(srv, sink)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.invalid:4317")

	var dials atomic.Int64
	p, err := telemetry.Setup(t.Context(), "test", telemetry.WithDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		dials.Add(1)
		assert.Equal(t, "collector.invalid:4317", addr, "the dialer gets the endpoint unresolved")
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}))
	require.NoError(t, err)
	_, span := p.TracerProvider().Tracer("test").Start(t.Context(), "through the relay")
	span.End()
	require.NoError(t, p.Shutdown(t.Context()), "the batch is flushed through the dialer")
	require.Equal(t, int64(1), sink.spans.Load())
	require.Positive(t, dials.Load())
}
