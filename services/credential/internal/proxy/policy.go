package proxy

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
)

// RoutePolicy is what one forwarding route lets through: the request
// methods and the request header names. Everything else is refused (405)
// or dropped. An allowlist, not a denylist: a header nobody thought of
// (an upstream's billing or routing header) never reaches the upstream.
type RoutePolicy struct {
	Methods []string // upper case, e.g. GET
	// Headers are header names (case-insensitive), or a prefix ending in
	// "*" ("X-Stainless-*"). The proxy's own strip rules (credentials,
	// identity, hop-by-hop, x-agentplane-*) apply on top.
	Headers []string

	methods map[string]bool
	exact   map[string]bool // lower case
	prefix  []string        // lower case, without the "*"
}

// Default policies (docs/credential.md, "Methods and headers").
var (
	// DefaultProviderPolicy fits an OpenAI-compatible client: its calls are
	// GET (models) and POST (completions, embeddings, responses).
	DefaultProviderPolicy = RoutePolicy{
		Methods: []string{http.MethodGet, http.MethodPost},
		Headers: []string{"Accept", "Accept-Language", "Content-Type", "Content-Length", "User-Agent",
			"X-Request-Id", "Idempotency-Key", "OpenAI-Beta", "X-Stainless-*"},
	}
	// DefaultBackendPolicy is a REST backend's.
	DefaultBackendPolicy = RoutePolicy{
		Methods: []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodHead},
		Headers: []string{"Accept", "Accept-Language", "Content-Type", "Content-Length", "User-Agent",
			"X-Request-Id", "Idempotency-Key", "If-Match", "If-None-Match"},
	}
)

// ingestMethods are the ingest route's operations' methods, by operation.
var ingestMethods = map[string]string{"items": http.MethodPost, "export": http.MethodGet, "title": http.MethodPut}

// neverMethods echo the request (TRACE: the backing credential with it)
// or open a tunnel (CONNECT): no policy may admit them.
var neverMethods = map[string]bool{http.MethodTrace: true, http.MethodConnect: true, "TRACK": true}

// ParseMethods reads a comma-separated method list, as configured.
func ParseMethods(s string) ([]string, error) {
	var out []string
	for f := range strings.SplitSeq(s, ",") {
		m := strings.TrimSpace(f)
		if m == "" {
			continue
		}
		if !isToken(m) || m != strings.ToUpper(m) {
			return nil, fmt.Errorf("method %q: want an upper-case HTTP method", m)
		}
		if neverMethods[m] {
			return nil, fmt.Errorf("method %s is never forwarded (it echoes the request or opens a tunnel)", m)
		}
		if !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("at least one method")
	}
	return out, nil
}

// ParseHeaders reads a comma-separated header allowlist, as configured. A
// name the proxy always strips is an error, not silently ignored.
func ParseHeaders(s string) ([]string, error) {
	var out []string
	for f := range strings.SplitSeq(s, ",") {
		h := strings.TrimSpace(f)
		if h == "" {
			continue
		}
		name, isPrefix := strings.CutSuffix(h, "*")
		if !isToken(name) {
			return nil, fmt.Errorf("header %q: want a header name or a prefix ending in *", h)
		}
		if isPrefix && len(name) < 3 {
			return nil, fmt.Errorf("header prefix %q: too short (at least 3 characters before *)", h)
		}
		if stripped(strings.ToLower(name)) {
			return nil, fmt.Errorf("header %q is always stripped (a credential, identity, hop-by-hop or x-agentplane-* header)", h)
		}
		out = append(out, h)
	}
	return out, nil
}

// compile builds the lookup sets; a policy with no methods gets def's.
func (p RoutePolicy) compile(def RoutePolicy) RoutePolicy {
	if len(p.Methods) == 0 && p.Headers == nil {
		p = def
	}
	c := RoutePolicy{Methods: slices.Clone(p.Methods), Headers: slices.Clone(p.Headers), methods: map[string]bool{}, exact: map[string]bool{}}
	for _, m := range p.Methods {
		if !neverMethods[m] {
			c.methods[m] = true
		}
	}
	for _, h := range p.Headers {
		h = strings.ToLower(h)
		if name, ok := strings.CutSuffix(h, "*"); ok {
			c.prefix = append(c.prefix, name)
		} else {
			c.exact[h] = true
		}
	}
	return c
}

// allowsMethod reports whether m may be forwarded.
func (p *RoutePolicy) allowsMethod(m string) bool { return p.methods[m] }

// allow is the Allow header value of a 405.
func (p *RoutePolicy) allow() string { return strings.Join(p.Methods, ", ") }

// allowsHeader reports whether the lower-case name n may be forwarded.
func (p *RoutePolicy) allowsHeader(n []byte) bool {
	if p.exact[string(n)] {
		return true
	}
	for _, pre := range p.prefix {
		if len(n) > len(pre) && string(n[:len(pre)]) == pre {
			return true
		}
	}
	return false
}

// isToken reports whether s is a non-empty RFC 9110 token (method and
// header name syntax).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}
