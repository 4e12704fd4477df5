package telemetry_test

import (
	"context"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

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
