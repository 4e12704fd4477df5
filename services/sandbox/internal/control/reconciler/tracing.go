package reconciler

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// tracer names the reconciler's spans (one per stop attempt).
var tracer = otel.Tracer("agentplane.dev/services/sandbox/reconciler")

func startStopSpan(ctx context.Context, attempt int) (context.Context, trace.Span) {
	return tracer.Start(ctx, "sandbox.stop_attempt", trace.WithAttributes(attribute.Int("agentplane.stop.attempt", attempt)))
}

func endStopSpan(span trace.Span, res provider.StopResult) {
	span.SetAttributes(attribute.String("agentplane.stop.result", StopResultLabel(res.Kind)))
	if res.Kind != provider.StopAbsent {
		span.SetStatus(codes.Error, "absence not verified")
	}
	span.End()
}

// StopResultLabel names a stop outcome for spans and the stop-attempt metric.
func StopResultLabel(k provider.StopKind) string {
	switch k {
	case provider.StopAbsent:
		return "absent"
	case provider.StopStillPresent:
		return "still_present"
	case provider.StopInspectionFailed:
		return "inspection_failed"
	}
	return "unknown"
}
