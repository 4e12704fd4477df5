package proxy

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracer names the proxy's request spans.
var tracer = otel.Tracer("agentplane.dev/services/credential/proxy")

// Handler is the proxy with a request span and the request metrics around
// it. The span continues the runtime's `traceparent`, so the proxy's ingest
// calls (made with the request's context) are its children. Span and
// labels name the route only: never the sandbox id, path or handle.
func (p *Proxy) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		route := routeLabel(r.URL.Path)
		ctx := propagation.TraceContext{}.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, span := tracer.Start(ctx, "credential.proxy "+route, trace.WithSpanKind(trace.SpanKindServer))
		rec := &statusRecorder{ResponseWriter: w}
		start := time.Now()
		audit := &auditState{}
		ctx = context.WithValue(ctx, auditKey{}, audit)
		var body *countingBody
		if r.Body != nil && r.Body != http.NoBody {
			body = &countingBody{ReadCloser: r.Body}
			r.Body = body
		}
		defer func() {
			code := rec.status()
			var in uint64
			if body != nil {
				in = body.n.Load()
			}
			p.report(audit, r.Method, code, in, rec.written, start, time.Since(start))
			span.SetAttributes(attribute.String("agentplane.proxy.route", route), attribute.Int("http.response.status_code", code))
			if code >= 500 {
				span.SetStatus(codes.Error, http.StatusText(code))
			}
			span.End()
			p.metrics.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
			p.metrics.duration.WithLabelValues(route).Observe(time.Since(start).Seconds())
		}()
		p.ServeHTTP(rec, r.WithContext(ctx))
	})
}

// routeLabel is the route segment of /s/<sandbox>/<route>/..., or "unknown":
// a bounded label whatever the caller sends.
func routeLabel(path string) string {
	rest, ok := strings.CutPrefix(path, "/s/")
	if !ok {
		return "unknown"
	}
	_, rest, _ = strings.Cut(rest, "/")
	route, _, _ := strings.Cut(rest, "/")
	switch Route(route) {
	case RouteProvider, RouteBackend, RouteIngest, RouteGit:
		return route
	}
	return "unknown"
}

// statusRecorder remembers the response status; Unwrap keeps
// http.ResponseController (flushing event streams) working through it.
type statusRecorder struct {
	http.ResponseWriter
	code    int
	written uint64 // body bytes
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	n, err := s.ResponseWriter.Write(b)
	s.written += uint64(n) //nolint:gosec // n ≥ 0
	return n, err
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

func (s *statusRecorder) status() int {
	if s.code == 0 {
		return http.StatusOK
	}
	return s.code
}
