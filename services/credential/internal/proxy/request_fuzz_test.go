package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sort"
	"strings"
	"sync"
	"testing"

	"agentplane.dev/services/credential/attestation"
	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
)

// fixedResolver resolves one handle, for sandbox sbx-a only (a pure unit
// double: the store is not what this fuzz target exercises).
type fixedResolver struct {
	raw string
	res *grants.Resolved
}

func (f fixedResolver) Resolve(_ context.Context, raw, sandboxID string) (*grants.Resolved, error) {
	switch {
	case raw != f.raw:
		return nil, scope.ErrUnknownHandle
	case sandboxID != "sbx-a":
		return nil, scope.ErrSandboxMismatch
	}
	return f.res, nil
}

// seenRequest is what the echoing upstream received.
type seenRequest struct {
	method, path string
	header       http.Header
}

// echoUpstream is a real HTTP server that reflects every request into its
// response body, and into response headers too on paths holding "hdr".
type echoUpstream struct {
	mu   sync.Mutex
	seen []seenRequest
}

func (u *echoUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.seen = append(u.seen, seenRequest{r.Method, r.URL.Path, r.Header.Clone()})
	u.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s\r\n", r.Method, r.URL.RequestURI())
	names := make([]string, 0, len(r.Header))
	for k := range r.Header {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		fmt.Fprintf(&b, "%s: %s\r\n", k, strings.Join(r.Header[k], ", "))
		if strings.Contains(r.URL.Path, "hdr") {
			w.Header()["Echo-"+k] = r.Header[k]
		}
	}
	body, _ := io.ReadAll(r.Body)
	b.Write(body)
	_, _ = io.WriteString(w, b.String())
}

func (u *echoUpstream) take() []seenRequest {
	u.mu.Lock()
	defer u.mu.Unlock()
	s := u.seen
	u.seen = nil
	return s
}

// FuzzProxyRequest sends whole HTTP requests (method, target, header
// lines, body) that net/http accepts through the proxy to a real echoing
// upstream. Whatever the request, the proxy's answer (status line, headers,
// body) never holds the backing secret or the attestation it sent, and the
// upstream sees only the route's allowlisted methods and headers, plus the
// credential and attestation the proxy sets.
//
//	go test ./internal/proxy -run '^$' -fuzz FuzzProxyRequest -fuzztime 60s
func FuzzProxyRequest(f *testing.F) {
	const secret = "sk-fuzz-backing-secret-0123456789"
	raw, err := handle.New(handle.Worktree)
	if err != nil {
		f.Fatal(err)
	}
	up := &echoUpstream{}
	srv := httptest.NewServer(up)
	f.Cleanup(srv.Close)
	provider, _ := url.Parse(srv.URL + "/prov")
	backend, _ := url.Parse(srv.URL + "/back")
	key := []byte(strings.Repeat("k", 32))
	res := &grants.Resolved{Secret: []byte(secret), SecretDigest: grants.SecretDigest([]byte(secret)),
		Member: scope.Member{UserID: "u1", SessionID: "s1", RuntimeSessionID: "rs-s1"}}
	res.Grant.Scope = scope.Scope{SandboxID: "sbx-a", Directory: "/w/repo"}
	p, err := New(Config{Resolver: fixedResolver{raw: raw, res: res}, ProviderUpstream: provider, BackendUpstream: backend, AttestationKey: key})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(p.Close)

	for _, s := range [][3]string{
		{"GET", "/s/sbx-a/provider/v1/models", "Accept: application/json"},
		{"POST", "/s/sbx-a/provider/v1/chat/completions", "Content-Type: application/json\nOpenAI-Organization: org-x\nOpenAI-Beta: v2"},
		{"TRACE", "/s/sbx-a/provider/hdr", "Max-Forwards: 0"},
		{"CONNECT", "/s/sbx-a/backend/x", ""},
		{"PATCH", "/s/sbx-a/backend/hdr/echo", "X-HTTP-Method-Override: TRACE\nX-Forwarded-For: 1.2.3.4\nConnection: X-Stainless-Lang\nX-Stainless-Lang: js"},
		{"DELETE", "/s/sbx-a/backend/hdr", "Authorization: Bearer other\nCookie: a=b\nX-Agentplane-Attestation: forged"},
		{"HEAD", "/s/sbx-a/backend/hdr", "If-Match: *\nX-Api-Key: k"},
		{"POST", "/s/sbx-b/provider/x", "Private-Token: t"},
		{"GET", "/s/sbx-a/provider/%2e%2e/x", ""},
		{"POST", "/s/sbx-a/ingest/v1/sessions/rs-s1/items", "Content-Type: application/json"},
		{"FOO", "/s/sbx-a/provider/x", "X-Stainless-" + strings.Repeat("a", 70) + ": long"},
	} {
		f.Add(s[0], s[1], s[2], "body "+secret[:6])
	}
	f.Fuzz(func(t *testing.T, method, target, headerLines, body string) {
		var req strings.Builder
		fmt.Fprintf(&req, "%s %s HTTP/1.1\r\nHost: proxy\r\n", method, target)
		hasAuth := false
		for l := range strings.SplitSeq(headerLines, "\n") {
			if l = strings.TrimRight(l, "\r"); l != "" {
				req.WriteString(l + "\r\n")
				hasAuth = hasAuth || strings.HasPrefix(strings.ToLower(l), "authorization:")
			}
		}
		if !hasAuth {
			req.WriteString("Authorization: Bearer " + raw + "\r\n")
		}
		fmt.Fprintf(&req, "Content-Length: %d\r\n\r\n%s", len(body), body)
		r, err := http.ReadRequest(bufio.NewReader(strings.NewReader(req.String())))
		if err != nil || len(r.Header) > 400 {
			return // net/http refuses it before the proxy's handler runs
		}
		rec := httptest.NewRecorder()
		func() {
			defer func() {
				if v := recover(); v != nil && !errors.Is(asError(v), http.ErrAbortHandler) {
					panic(v)
				}
			}()
			p.ServeHTTP(rec, r)
		}()
		seen := up.take()
		var atts []string
		for _, s := range seen {
			atts = append(atts, s.header.Get(attestation.Header))
			route := RouteProvider
			if strings.HasPrefix(s.path, "/back/") {
				route = RouteBackend
			}
			pol := p.routes[route]
			if !pol.allowsMethod(s.method) {
				t.Fatalf("method %q reached the %s upstream", s.method, route)
			}
			for k, vs := range s.header {
				var buf [64]byte
				n := lowerName(&buf, k)
				switch string(n) {
				case "authorization":
					if len(vs) != 1 || vs[0] != "Bearer "+secret {
						t.Fatalf("upstream Authorization %q", vs)
					}
				case "x-agentplane-attestation":
					if len(vs) != 1 {
						t.Fatalf("upstream got %d attestations", len(vs))
					}
				default:
					if !pol.allowsHeader(n) {
						t.Fatalf("header %q outside the %s allowlist reached the upstream", k, route)
					}
				}
			}
		}
		answer := rec.Body.String()
		for k, vs := range rec.Header() {
			answer += "\n" + k + ": " + strings.Join(vs, ", ")
		}
		if strings.Contains(answer, secret) {
			t.Fatalf("the backing secret is in the answer (%d)", rec.Code)
		}
		for _, a := range atts {
			if a != "" && strings.Contains(answer, a) {
				t.Fatalf("the attestation is in the answer (%d)", rec.Code)
			}
		}
	})
}

func asError(v any) error {
	if err, ok := v.(error); ok {
		return err
	}
	return nil
}
