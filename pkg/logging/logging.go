// Package logging sets up log/slog for agentplane processes: JSON lines by default (text for
// people at a terminal), a level, and trace_id/span_id on every record logged with a context
// that carries an OpenTelemetry span, so a log line can be joined with its trace.
package logging

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"go.opentelemetry.io/otel/trace"
)

// Format selects the slog handler.
type Format string

const (
	// JSON is the production format: one JSON object per line.
	JSON Format = "json"
	// Text is slog's key=value format, easier to read in a terminal.
	Text Format = "text"
)

// ParseFormat accepts "json" or "text" (case-insensitive); "" means JSON.
func ParseFormat(s string) (Format, error) {
	switch f := Format(strings.ToLower(s)); f {
	case "", JSON:
		return JSON, nil
	case Text:
		return Text, nil
	default:
		return "", fmt.Errorf("unknown log format %q (want json or text)", s)
	}
}

// New returns a logger writing to w in the given format at the given level, with trace ids
// added from the context of each record.
func New(w io.Writer, format Format, level slog.Leveler) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	if format == Text {
		h = slog.NewTextHandler(w, opts)
	} else {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(WithTraceIDs(h))
}

// WithTraceIDs wraps h so that every record whose context carries a valid span gets
// trace_id and span_id attributes.
func WithTraceIDs(h slog.Handler) slog.Handler {
	if _, ok := h.(traceHandler); ok {
		return h
	}
	return traceHandler{h}
}

type traceHandler struct{ slog.Handler }

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r = r.Clone()
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return traceHandler{h.Handler.WithAttrs(attrs)}
}

func (h traceHandler) WithGroup(name string) slog.Handler {
	return traceHandler{h.Handler.WithGroup(name)}
}
