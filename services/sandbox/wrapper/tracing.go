package wrapper

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracer names the wrapper's spans. They continue the trace the sandbox
// service sends in PrepareRoute and Deliver frames (the control stream is
// one long-lived call, so its own trace context would tie every message to
// the wrapper's connect).
var tracer = otel.Tracer("agentplane.dev/services/sandbox/wrapper")

// startFrameSpan starts a span whose parent is a frame's traceparent.
func startFrameSpan(traceparent, name string) (context.Context, trace.Span) {
	parent := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": traceparent})
	return tracer.Start(parent, name)
}

// traceparentOf is ctx's W3C traceparent ("" when untraced).
func traceparentOf(ctx context.Context) string {
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, c)
	return c["traceparent"]
}
