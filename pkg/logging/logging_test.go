package logging_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"agentplane.dev/pkg/logging"
	"agentplane.dev/pkg/logging/logtest"
)

func TestTraceIDsOnEveryLine(t *testing.T) {
	var buf bytes.Buffer
	log := logging.New(&buf, logging.JSON, slog.LevelInfo).With("service", "test")

	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:     trace.SpanID{1, 2, 3, 4, 5, 6, 7, 8},
		TraceFlags: trace.FlagsSampled,
	})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	log.InfoContext(ctx, "with span")
	log.DebugContext(ctx, "below level")

	var line map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &line))
	require.Equal(t, sc.TraceID().String(), line["trace_id"])
	require.Equal(t, sc.SpanID().String(), line["span_id"])
	require.Equal(t, "test", line["service"])

	buf.Reset()
	log.Info("no span")
	line = nil
	require.NoError(t, json.Unmarshal(buf.Bytes(), &line))
	require.NotContains(t, line, "trace_id")
}

func TestParseFormat(t *testing.T) {
	for in, want := range map[string]logging.Format{"": logging.JSON, "JSON": logging.JSON, "text": logging.Text} {
		got, err := logging.ParseFormat(in)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	_, err := logging.ParseFormat("xml")
	require.Error(t, err)
}

func TestLogtest(t *testing.T) {
	logtest.New(t).Info("visible with -v")
}
