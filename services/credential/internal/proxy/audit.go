package proxy

import (
	"context"
	"io"
	"regexp"
	"strings"
	"sync/atomic"
	"time"

	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/handle"
)

// AuditReport is one request the proxy forwarded (or refused after its
// handle resolved) for a session: DESIGN.md 5 "Usage and audit". It names
// the path by a template only: never the raw path, the query or a header.
type AuditReport struct {
	SessionID, SandboxID, RuntimeSessionID string
	// RuntimeKey is the runtime the handle serves: the worktree directory
	// for a worktree handle, the session for a per-session one.
	RuntimeKey   string
	Route        Route
	Method       string
	PathTemplate string
	Status       int
	// BytesIn is the request body read from the runtime, BytesOut the
	// response body sent to it.
	BytesIn, BytesOut uint64
	Start             time.Time
	Duration          time.Duration
}

// AuditSink takes each report once the response ended. It must not block
// (a sink queues and drops when full): the proxy calls it on the
// request's goroutine.
type AuditSink interface {
	RecordRequest(r AuditReport)
}

// auditKey carries a request's *auditState from Handler to ServeHTTP.
type auditKey struct{}

// auditState is what ServeHTTP learns of a request for its report: the
// resolution and the parsed target, once the handle resolved.
type auditState struct {
	res    *grants.Resolved
	target Target
}

func auditOf(ctx context.Context) *auditState {
	s, _ := ctx.Value(auditKey{}).(*auditState)
	return s
}

// resolved records the request's resolution for its audit report.
func resolved(ctx context.Context, t Target, res *grants.Resolved) {
	if s := auditOf(ctx); s != nil {
		s.res, s.target = res, t
	}
}

// countingBody counts what the proxy read of the caller's body.
type countingBody struct {
	io.ReadCloser
	n atomic.Uint64
}

func (c *countingBody) Read(b []byte) (int, error) {
	n, err := c.ReadCloser.Read(b)
	c.n.Add(uint64(n)) //nolint:gosec // n ≥ 0
	return n, err
}

// report sends the audit report of a finished request: only of the
// routes that reach an upstream for the session (provider, backend, git)
// and only once its handle resolved.
func (p *Proxy) report(s *auditState, method string, status int, in, out uint64, start time.Time, took time.Duration) {
	if p.cfg.Audit == nil || s == nil || s.res == nil {
		return
	}
	t := s.target
	if t.Route != RouteProvider && t.Route != RouteBackend && t.Route != RouteGit {
		return
	}
	res := s.res
	key := res.Member.SessionID
	if res.Grant.Kind == handle.Worktree {
		key = res.Grant.Scope.Directory
	}
	p.cfg.Audit.RecordRequest(AuditReport{
		SessionID: res.Member.SessionID, SandboxID: res.Grant.Scope.SandboxID, RuntimeSessionID: res.Member.RuntimeSessionID,
		RuntimeKey: key, Route: t.Route, Method: method, PathTemplate: PathTemplate(t),
		Status: status, BytesIn: in, BytesOut: out, Start: start, Duration: took,
	})
}

// plainSegment is a path segment a template keeps: a short lower-case
// word with at most two trailing digits (v1, chat, completions,
// git-upload-pack). Anything else may name something (an id, a model, a
// file, a secret someone put in a path) and becomes {id}.
var plainSegment = regexp.MustCompile(`^[a-z][a-z_-]{0,31}[0-9]{0,2}$`)

// maxTemplateSegments bounds a template's length.
const maxTemplateSegments = 16

// PathTemplate is the path below the route with every segment that may
// name something replaced by {id}; on the git route the repository (host
// and path) is {repo} followed by the endpoint when it is one of the
// route's. Never the query.
func PathTemplate(t Target) string {
	rest := t.Rest
	if t.Route == RouteGit {
		for _, e := range gitEndpoints {
			if len(rest) > len(e.suffix) && equalSegs(rest[len(rest)-len(e.suffix):], e.suffix) {
				return "{repo}/" + strings.Join(e.suffix, "/")
			}
		}
		return "{repo}"
	}
	var b strings.Builder
	for i, s := range rest {
		if i == maxTemplateSegments {
			b.WriteString("/…")
			break
		}
		if i > 0 {
			b.WriteByte('/')
		}
		if plainSegment.MatchString(s) {
			b.WriteString(s)
		} else {
			b.WriteString("{id}")
		}
	}
	return b.String()
}
