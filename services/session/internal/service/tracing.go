package service

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
)

// tracer names the session service's own spans (drains, deletion steps).
var tracer = otel.Tracer("agentplane.dev/services/session")

// pendingTraces remembers, per session, the span of the SendMessage call
// whose message is still queued, so the asynchronous drain that prepares
// the route and then delivers it continues that caller's trace (client →
// session → sandbox → wrapper → proxy → ingest). Process memory only: a
// drain on another replica starts a new trace, which is a lost link, not
// a wrong one.
type pendingTraces struct{ m sync.Map } // session id → trace.SpanContext

func (p *pendingTraces) remember(ctx context.Context, id string) {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		p.m.Store(id, sc)
	}
}

// drainCtx is ctx parented to the remembered caller span of id, if any.
func (p *pendingTraces) drainCtx(ctx context.Context, id string) context.Context {
	if v, ok := p.m.Load(id); ok {
		return trace.ContextWithRemoteSpanContext(ctx, v.(trace.SpanContext))
	}
	return ctx
}

// delivered forgets id's caller span once its messages went out.
func (p *pendingTraces) delivered(id string) { p.m.Delete(id) }
