package driver

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracer names the sandbox driver's own spans: preparation steps, stop
// attempts, wipes.
var tracer = otel.Tracer("agentplane.dev/services/sandbox")

// routeTraces remembers the span of the Prepare call per sandbox and
// session, so the asynchronous preparation (and the PrepareRoute frame the
// wrapper continues) joins the caller's trace. Process memory only.
var routeTraces sync.Map // sandboxID+"/"+sessionID → trace.SpanContext

func rememberRoute(ctx context.Context, sandboxID, sessionID string) {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		routeTraces.Store(sandboxID+"/"+sessionID, sc)
	}
}

// routeCtx is ctx parented to the remembered Prepare span of the route.
func routeCtx(ctx context.Context, sandboxID, sessionID string) context.Context {
	if v, ok := routeTraces.Load(sandboxID + "/" + sessionID); ok {
		return trace.ContextWithRemoteSpanContext(ctx, v.(trace.SpanContext))
	}
	return ctx
}

func forgetRouteTrace(sandboxID, sessionID string) { routeTraces.Delete(sandboxID + "/" + sessionID) }

// traceparent is ctx's W3C trace context for a wrapper frame ("" when untraced).
func traceparent(ctx context.Context) string {
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, c)
	return c["traceparent"]
}
