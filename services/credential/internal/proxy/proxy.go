// Package proxy is the HTTP credential proxy runtimes call instead of their
// upstreams: /s/<sandbox-id>/{provider,backend,ingest}/... with
// "Authorization: Bearer <handle>". It resolves the handle (bound to the
// sandbox in the URL), strips everything the caller said about credentials
// and identity, sets the backing credential and a short-lived attestation,
// and forwards without following redirects.
package proxy

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/pkg/expiring"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/storeerr"
	"agentplane.dev/services/credential/attestation"
	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/scope"
	"agentplane.dev/services/credential/internal/usage"
)

// Resolver resolves a handle for a request under a sandbox's URL.
type Resolver interface {
	Resolve(ctx context.Context, raw, sandboxID string) (*grants.Resolved, error)
}

// Config configures the proxy.
type Config struct {
	Resolver         Resolver
	ProviderUpstream *url.URL // nil: the provider route answers 404
	BackendUpstream  *url.URL // nil: the backend route answers 404
	// Provider and Backend are the routes' method and header allowlists;
	// zero: DefaultProviderPolicy, DefaultBackendPolicy.
	Provider, Backend RoutePolicy
	Ingest            ingestv1.IngestServiceClient
	// Usage takes the token usage of provider responses; nil: read but
	// not reported (nor written to the history).
	Usage UsageSink
	// Audit takes a report of every provider, backend and git request
	// once its response ended (Handler only); nil: none.
	Audit AuditSink
	Git   GitCredentials // nil: the git route answers 404
	// GitPrivateNetworks are networks (CIDRs or addresses) the git route
	// may dial although the address policy refuses them (an in-house git
	// server, the tests' loopback git http-backend); nil, the default:
	// none, every private, loopback, link-local or reserved address and
	// its IPv6 forms are refused at dial time (egresspolicy.Restricted).
	GitPrivateNetworks []string
	AttestationKey     []byte
	Registerer         prometheus.Registerer // proxy denial metrics; nil: not registered
	// ResolveBudget bounds retrying a resolution while the store is
	// unavailable (a Redis failover), within the request's own deadline;
	// 0: no retry.
	ResolveBudget time.Duration
	Logger        *slog.Logger
	Now           func() time.Time
}

// Proxy is the http.Handler.
type Proxy struct {
	cfg     Config
	routes  map[Route]*RoutePolicy // provider, backend (compiled)
	fwd     *forwarder
	gitFwd  *forwarder // dials only what the address policy allows
	metrics *metrics

	registered  sync.Map     // runtime session ids created in ingest by this process
	registeredN atomic.Int64 // entries in registered (bounded by maxRegistered)

	att *expiring.Map[*grants.Resolved, string] // recent attestations, by resolution
}

// Attestations are reused for the same resolution for attestationReuse
// (signing — JSON and HMAC — was 6% of the proxy's CPU per request); an
// upstream sees one at most that old, valid for the rest of its lifetime,
// and never one signed after its request's time. Those past reuse are
// dropped once per reuse period: each holds its resolution, and a released
// handle's would stay until maxAttestations pushed it out.
const (
	attestationReuse = time.Second
	maxAttestations  = 4096
)

// New builds the proxy.
func New(cfg Config) (*Proxy, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	provider, backend := cfg.Provider.compile(DefaultProviderPolicy), cfg.Backend.compile(DefaultBackendPolicy)
	git := GitPolicy.compile(GitPolicy)
	att := expiring.New[*grants.Resolved, string](expiring.Options{
		TTL: attestationReuse, SweepEvery: attestationReuse, Max: maxAttestations, FutureExpired: true})
	gitFwd := newForwarder()
	gitAddrs := egresspolicy.Policy{PrivateNetworks: cfg.GitPrivateNetworks}
	gitFwd.dialer.Control = egresspolicy.DialControl(gitAddrs.AllowsAddress)
	return &Proxy{cfg: cfg, metrics: m, fwd: newForwarder(), gitFwd: gitFwd, att: att,
		routes: map[Route]*RoutePolicy{RouteProvider: &provider, RouteBackend: &backend, RouteGit: &git}}, nil
}

// copyBuffers are the response body copy buffers.
var copyBuffers = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// ServeHTTP implements http.Handler. What the caller controls is checked
// before its handle is looked at, cheapest first: the header bounds, the
// path, the route, the route's method allowlist.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if n, size := headerSize(r.Header); n > MaxRequestHeaders || size > MaxRequestHeaderBytes {
		p.deny(w, "headers_too_large", http.StatusRequestHeaderFieldsTooLarge, "too many or too large request headers")
		return
	}
	t, err := ParseTarget(r.RequestURI)
	switch {
	case errors.Is(err, ErrBadPath):
		p.deny(w, "bad_path", http.StatusBadRequest, "refused path")
		return
	case err != nil:
		p.deny(w, "unknown_route", http.StatusNotFound, "no such route")
		return
	}
	upstream := p.upstreamOf(t.Route)
	if t.Route == RouteGit && p.cfg.Git == nil || t.Route != RouteIngest && t.Route != RouteGit && upstream == nil {
		p.deny(w, "unknown_route", http.StatusNotFound, "no such route")
		return
	}
	if allow, ok := p.methodAllowed(t, r.Method); !ok {
		if allow == "" {
			p.deny(w, "unknown_route", http.StatusNotFound, "no such route")
			return
		}
		w.Header().Set("Allow", allow)
		p.deny(w, "method", http.StatusMethodNotAllowed, "method not allowed on this route")
		return
	}
	raw, ok := bearer(r.Header)
	if !ok && t.Route == RouteGit {
		raw, ok = basicHandle(r)
	}
	if !ok {
		if t.Route == RouteGit {
			// git asks for credentials only after a challenge.
			w.Header().Set("WWW-Authenticate", `Basic realm="agentplane"`)
		}
		p.deny(w, "missing_handle", http.StatusUnauthorized, "bearer handle required")
		return
	}
	res, err := p.resolve(r.Context(), raw, t.SandboxID)
	if err != nil {
		p.denyResolve(w, r, err)
		return
	}
	resolved(r.Context(), t, res)
	if t.Route == RouteIngest {
		p.serveIngest(w, r, t, res)
		return
	}
	if t.Route == RouteGit {
		p.serveGit(w, r, t, res)
		return
	}
	p.serveUpstream(w, r, t, upstream, res)
}

// serveUpstream forwards a request of a configured route to its upstream
// with the resolved credential, and answers a refused response or a failed
// upstream.
func (p *Proxy) serveUpstream(w http.ResponseWriter, r *http.Request, t Target, upstream *url.URL, res *grants.Resolved) {
	if r.Body != nil && r.Body != http.NoBody {
		r.Body = &idleBody{ReadCloser: r.Body, rc: http.NewResponseController(w), idle: callerBodyIdle}
	}
	out, att := p.outgoing(r, upstream, t, res)
	var tap *usageTap
	if t.Route == RouteProvider {
		tap = &usageTap{p: p, sink: p.cfg.Usage, res: res}
		if r.Method == http.MethodPost && usage.IsChatCompletions(t.Rest) {
			model, err := askForUsage(out)
			if err != nil {
				p.deny(w, "request_body", http.StatusBadRequest, "request body unreadable")
				return
			}
			tap.model = model
		}
	}
	start := time.Now()
	err := p.fwd.forward(r.Context(), w, out, newEchoGuard(string(res.Secret), att), tap)
	p.metrics.upstream.WithLabelValues(string(t.Route)).Observe(time.Since(start).Seconds())
	if err == nil {
		return
	}
	if errors.Is(err, errEchoed) {
		p.cfg.Logger.WarnContext(r.Context(), "proxy refused an upstream response that echoed a credential", "route", t.Route)
	}
	if p.refuseResponse(w, err) {
		return
	}
	p.upstreamFailed(w, r, err, "proxy upstream failed", "route", t.Route)
}

// refuseResponse answers an upstream response the proxy refused (it
// echoed a credential, its head is too large, its body is encoded) with
// a 502 naming the reason; false when err is none of those.
func (p *Proxy) refuseResponse(w http.ResponseWriter, err error) bool {
	var reason string
	switch {
	case errors.Is(err, errEchoed):
		reason = "response_echo"
	case errors.Is(err, errResponseHead):
		reason = "response_headers_too_large"
	case errors.Is(err, errEncoded):
		reason = "response_encoded"
	default:
		return false
	}
	p.deny(w, reason, http.StatusBadGateway, "upstream response refused")
	return true
}

// upstreamFailed answers a forward whose upstream failed: counted and
// logged (msg, attrs) unless the caller went away, which is not an
// upstream failure; a 502, or a response cut short when its status is
// already out (never ended cleanly).
func (p *Proxy) upstreamFailed(w http.ResponseWriter, r *http.Request, err error, msg string, attrs ...any) {
	if r.Context().Err() == nil {
		p.metrics.upstreamErrors.Inc()
		p.cfg.Logger.WarnContext(r.Context(), msg, append(attrs, "error", err.Error())...)
	}
	if errors.Is(err, errAfterHeaders) {
		panic(http.ErrAbortHandler)
	}
	writeError(w, http.StatusBadGateway, "upstream unavailable")
}

// methodAllowed checks the method against the route's allowlist; when it
// is refused, allow is the Allow header of the 405 ("" : no such ingest
// operation, a 404).
func (p *Proxy) methodAllowed(t Target, method string) (allow string, ok bool) {
	if t.Route == RouteIngest {
		op, known := ingestOp(t)
		if !known {
			return "", false
		}
		want := ingestMethods[op]
		return want, method == want
	}
	pol := p.routes[t.Route]
	return pol.allow(), pol.allowsMethod(method)
}

func (p *Proxy) upstreamOf(r Route) *url.URL {
	switch r {
	case RouteProvider:
		return p.cfg.ProviderUpstream
	case RouteBackend:
		return p.cfg.BackendUpstream
	}
	return nil
}

// bearer returns the handle of exactly one "Authorization: Bearer" header.
func bearer(h http.Header) (string, bool) {
	var vals []string
	for k, v := range h {
		if strings.EqualFold(k, "authorization") {
			vals = append(vals, v...)
		}
	}
	if len(vals) != 1 {
		return "", false
	}
	scheme, tok, ok := strings.Cut(vals[0], " ")
	if !ok || !strings.EqualFold(scheme, "bearer") || tok == "" {
		return "", false
	}
	return strings.TrimSpace(tok), true
}

// resolve resolves the handle, retrying with backoff while the store is
// unavailable, for up to ResolveBudget and within the request's deadline:
// a runtime's call rides out a Redis failover (seconds) instead of
// failing, and the scripted runtime does not retry by itself.
func (p *Proxy) resolve(ctx context.Context, raw, sandboxID string) (*grants.Resolved, error) {
	res, err := p.cfg.Resolver.Resolve(ctx, raw, sandboxID)
	if err == nil || p.cfg.ResolveBudget <= 0 || !storeerr.Unavailable(err) {
		return res, err
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.ResolveBudget)
	defer cancel()
	pause := 50 * time.Millisecond
	for {
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
		p.metrics.resolveRetries.Inc()
		if res, err = p.cfg.Resolver.Resolve(ctx, raw, sandboxID); err == nil || !storeerr.Unavailable(err) {
			return res, err
		}
	}
}

func (p *Proxy) denyResolve(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, grants.ErrMalformedHandle):
		p.deny(w, "invalid_handle", http.StatusUnauthorized, "invalid handle")
	case errors.Is(err, scope.ErrUnknownHandle):
		p.deny(w, "unknown_handle", http.StatusUnauthorized, "invalid handle")
	case errors.Is(err, scope.ErrNoLiveMember):
		p.deny(w, "no_live_member", http.StatusUnauthorized, "invalid handle")
	case errors.Is(err, scope.ErrSandboxMismatch):
		p.deny(w, "sandbox_mismatch", http.StatusForbidden, "handle not valid for this sandbox")
	default:
		p.cfg.Logger.ErrorContext(r.Context(), "proxy resolve failed", "error", err.Error())
		p.deny(w, "unavailable", http.StatusServiceUnavailable, "credential store unavailable")
	}
}

func (p *Proxy) deny(w http.ResponseWriter, reason string, code int, msg string) {
	p.metrics.denials.WithLabelValues(reason).Inc()
	writeError(w, code, msg)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(`{"error":{"code":` + strconv.Itoa(code) + `,"message":"` + msg + `"}}`))
}

func (p *Proxy) attestation(res *grants.Resolved) (string, error) {
	now := p.cfg.Now()
	if v, ok := p.att.Get(res, now); ok {
		return v, nil
	}
	v, err := attestation.Sign(p.cfg.AttestationKey, attestation.Claims{
		UserID: res.Member.UserID, OrgID: res.Member.OrgID,
		SandboxID: res.Grant.Scope.SandboxID, Directory: res.Grant.Scope.Directory,
		SessionID: res.Member.SessionID, RuntimeSessionID: res.Member.RuntimeSessionID,
		HandleKind: res.Grant.Kind.String(), SecretDigest: res.SecretDigest,
	}, now, attestation.MaxLifetime)
	if err != nil {
		return "", err
	}
	p.att.Put(res, v, now)
	return v, nil
}

// outgoing builds the upstream request: the checked path under the upstream
// base, the caller's query, the filtered headers, the backing credential and
// the attestation (returned too: the response must not echo it). It takes
// over r's header map and body.
func (p *Proxy) outgoing(r *http.Request, upstream *url.URL, t Target, res *grants.Resolved) (*http.Request, string) {
	u := *upstream
	base := strings.TrimSuffix(u.EscapedPath(), "/")
	esc := make([]string, len(t.Rest))
	for i, s := range t.Rest {
		esc[i] = url.PathEscape(s)
	}
	u.RawPath = base + "/" + strings.Join(esc, "/")
	u.Path = strings.TrimSuffix(u.Path, "/") + "/" + strings.Join(t.Rest, "/")
	u.RawQuery = t.RawQuery
	h := r.Header
	FilterRequest(h)
	keepAllowed(h, p.routes[t.Route])
	h.Set("Authorization", "Bearer "+string(res.Secret))
	att, err := p.attestation(res)
	if err == nil {
		h.Set(attestation.Header, att)
	}
	if _, ok := h["User-Agent"]; !ok {
		h.Set("User-Agent", "") // no Go default identifying the proxy
	}
	out := &http.Request{
		Method: r.Method, URL: &u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: h, Body: r.Body, ContentLength: r.ContentLength,
	}
	if r.ContentLength == 0 {
		out.Body = nil
	}
	return out, att
}

// Close drops idle upstream connections (after the HTTP server stopped).
func (p *Proxy) Close() { p.fwd.closeIdle(); p.gitFwd.closeIdle() }
