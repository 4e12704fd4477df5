package server

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/credential/attestation"
)

// rawResponse is what the proxy answered to a request sent byte for byte.
type rawResponse struct {
	status int
	header http.Header
	body   string
}

// rawDo sends one request exactly as written (any method, any number of
// headers) and reads the answer.
func (h *harness) rawDo(t *testing.T, method, target string, headers []string, body string) rawResponse {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(h.proxyURL, "http://"))
	require.NoError(t, err)
	defer c.Close()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n", method, target)
	for _, l := range headers {
		b.WriteString(l + "\r\n")
	}
	fmt.Fprintf(&b, "Content-Length: %d\r\n\r\n%s", len(body), body)
	_, err = io.WriteString(c, b.String())
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: method})
	require.NoError(t, err)
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	return rawResponse{status: resp.StatusCode, header: resp.Header, body: string(got)}
}

// upstreamSaw returns how many requests reached the upstream.
func (h *harness) upstreamSaw() int {
	h.up.mu.Lock()
	defer h.up.mu.Unlock()
	return len(h.up.got)
}

// denials reads the proxy denial counter for reason from /metrics.
func (h *harness) denials(t *testing.T, reason string) int {
	t.Helper()
	resp, err := h.http.Get(h.metrics)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`agentplane_credential_proxy_denials_total\{reason="` + reason + `"\} (\d+)`).FindSubmatch(body)
	if m == nil {
		return 0
	}
	n, err := strconv.Atoi(string(m[1]))
	require.NoError(t, err)
	return n
}

// Issue 19 item 1: each route forwards only its methods; everything else is
// 405 with Allow, counted, and never reaches the upstream. What an echoing
// upstream answers to an allowed method carries neither the backing secret
// nor the attestation.
func TestProxyMethodAllowlistsAgainstEchoingUpstream(t *testing.T) {
	h := startHarness(t)
	const secret = "sk-echo-backing-secret-4711"
	m := h.mint(t, "sbx-a", "/w/repo", "s1", secret, wt, 100)
	auth := "Authorization: Bearer " + m.handle

	routes := []struct {
		prefix  string
		allowed []string
	}{
		{"/s/sbx-a/provider/", []string{"GET", "POST"}},
		{"/s/sbx-a/backend/", []string{"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"}},
	}
	all := []string{"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "CONNECT", "TRACK",
		"PROPFIND", "MKCOL", "DEBUG", "FOO", "get"}
	refusals := 0
	for _, rt := range routes {
		for _, method := range all {
			allowed := false
			for _, a := range rt.allowed {
				allowed = allowed || a == method
			}
			if allowed {
				continue
			}
			before := h.upstreamSaw()
			got := h.rawDo(t, method, rt.prefix+"echo", []string{auth}, "")
			require.Equal(t, http.StatusMethodNotAllowed, got.status, "%s %s", method, rt.prefix)
			require.Equal(t, strings.Join(rt.allowed, ", "), got.header.Get("Allow"))
			require.Equal(t, before, h.upstreamSaw(), "%s %s reached the upstream", method, rt.prefix)
			require.NotContains(t, got.body, secret)
			refusals++
		}
		for _, method := range rt.allowed {
			for _, op := range []string{"echo", "echo-chunked"} {
				got := h.rawDo(t, method, rt.prefix+op, []string{auth, "Content-Type: text/plain"}, "hello")
				require.Equal(t, http.StatusOK, got.status, "%s %s%s", method, rt.prefix, op)
				seen := h.up.last()
				require.Equal(t, method, seen.Method)
				require.Equal(t, "Bearer "+secret, seen.Header.Get("Authorization"), "the upstream got the backing credential")
				att := seen.Header.Get(attestation.Header)
				require.NotEmpty(t, att)
				require.NotContains(t, got.body, secret, "%s %s%s", method, rt.prefix, op)
				require.NotContains(t, got.body, att)
				for k, vs := range got.header {
					require.NotContains(t, k+strings.Join(vs, ","), secret)
					require.NotContains(t, strings.Join(vs, ","), att)
				}
				if method != "HEAD" {
					// The echo arrives whole, the credentials overwritten in place.
					require.Contains(t, got.body, "Authorization: Bearer "+strings.Repeat("*", len(secret))+"\r\n")
					require.Contains(t, got.body, attestation.Header+": "+strings.Repeat("*", len(att))+"\r\n")
					require.True(t, strings.HasSuffix(got.body, "\r\n\r\nhello"), got.body)
				}
			}
			// Echoed into response headers or in a body the proxy cannot
			// read: the response is refused before any of it is sent.
			for _, op := range []string{"echo-headers", "echo-gzip"} {
				got := h.rawDo(t, method, rt.prefix+op, []string{auth}, "")
				require.Equal(t, http.StatusBadGateway, got.status, "%s %s%s", method, rt.prefix, op)
				require.NotContains(t, got.body, secret)
				require.Empty(t, got.header.Values("Echo-Authorization"))
			}
		}
	}

	// Ingest: each operation has its one method.
	for _, c := range []struct{ method, op, allow string }{
		{"GET", "items", "POST"}, {"TRACE", "items", "POST"}, {"POST", "export", "GET"}, {"CONNECT", "export", "GET"},
		{"DELETE", "title", "PUT"}, {"FOO", "title", "PUT"},
	} {
		got := h.rawDo(t, c.method, "/s/sbx-a/ingest/v1/sessions/rs-s1/"+c.op, []string{auth}, "")
		require.Equal(t, http.StatusMethodNotAllowed, got.status, "%s %s", c.method, c.op)
		require.Equal(t, c.allow, got.header.Get("Allow"))
		refusals++
	}
	h.ingest.mu.Lock()
	require.Empty(t, h.ingest.ingests)
	require.Empty(t, h.ingest.exports)
	h.ingest.mu.Unlock()

	require.Equal(t, refusals, h.denials(t, "method"))
	require.Equal(t, 2*(2+6), h.denials(t, "response_echo")+h.denials(t, "response_encoded"))
	require.Equal(t, 2+6, h.denials(t, "response_echo"))
}

// The names the issue saw reach the upstream verbatim under the denylist.
var notAllowlisted = []string{
	"OpenAI-Organization", "OpenAI-Project", "CF-Connecting-IP", "Fastly-Client-IP", "X-Original-URL",
	"X-Rewrite-URL", "X-HTTP-Method-Override", "X-Method-Override", "Private-Token", "X-Vault-Token",
	"X-Token", "Authorization-Token", "X-Host", "X-Original-Host", "X-Upstream-Host",
	"Accept-Encoding", "Range", "X-Custom", "Origin", "Referer",
}

// Issue 19 item 2: only a route's allowlisted request headers arrive.
func TestProxyRequestHeaderAllowlist(t *testing.T) {
	h := startHarness(t)
	m := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)
	allowed := map[string]string{
		"Accept": "application/json", "Accept-Language": "en", "Content-Type": "application/json",
		"User-Agent": "OpenAI/JS 4.0", "X-Request-Id": "req-1", "Idempotency-Key": "idem-1",
		"OpenAI-Beta": "assistants=v2", "X-Stainless-Lang": "js", "X-Stainless-Retry-Count": "0",
	}
	lines := []string{"Authorization: Bearer " + m.handle}
	for _, n := range notAllowlisted {
		for _, sp := range []string{n, strings.ToLower(n), mixedCase(n)} {
			lines = append(lines, sp+": caller-"+n)
		}
	}
	for k, v := range allowed {
		lines = append(lines, k+": "+v)
	}
	for _, route := range []string{"provider", "backend"} {
		got := h.rawDo(t, "POST", "/s/sbx-a/"+route+"/v1/chat/completions", lines, `{"model":"m"}`)
		require.Equal(t, http.StatusOK, got.status)
		seen := h.up.last()
		for _, n := range notAllowlisted {
			require.Empty(t, seen.Header.Values(n), "%s reached the %s upstream", n, route)
		}
		for k, v := range seen.Header {
			require.NotContains(t, strings.Join(v, ","), "caller-", "%s: %v", k, v)
		}
		for k, v := range allowed {
			if route == "backend" && (k == "OpenAI-Beta" || strings.HasPrefix(k, "X-Stainless")) {
				require.Empty(t, seen.Header.Values(k), "not in the backend's default allowlist")
				continue
			}
			require.Equal(t, v, seen.Header.Get(k), "%s on %s", k, route)
		}
		require.Equal(t, "13", seen.Header.Get("Content-Length"))
	}
}

// Issue 19 item 3: header count and size are bounded both ways.
func TestProxyHeaderBounds(t *testing.T) {
	h := startHarness(t)
	m := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-1", wt, 100)
	auth := "Authorization: Bearer " + m.handle
	headers := func(n int) []string {
		out := []string{auth}
		for i := range n {
			out = append(out, fmt.Sprintf("X-Stainless-H%d: v", i))
		}
		return out
	}
	before := h.upstreamSaw()
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, h.rawDo(t, "GET", "/s/sbx-a/provider/x", headers(10_000), "").status)
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, h.rawDo(t, "GET", "/s/sbx-a/provider/x", headers(98), "").status, "Authorization, Connection, Content-Length + 98 = 101 fields")
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, h.rawDo(t, "GET", "/s/sbx-a/provider/x",
		[]string{auth, "X-Stainless-Big: " + strings.Repeat("b", 40<<10)}, "").status, "40 KiB in one header")
	require.Equal(t, before, h.upstreamSaw(), "nothing too large reached the upstream")
	require.Equal(t, 2, h.denials(t, "headers_too_large"), "the HTTP server refuses the 10,000 before the handler")
	require.Equal(t, http.StatusOK, h.rawDo(t, "GET", "/s/sbx-a/provider/x", headers(97), "").status, "100 fields")

	for _, op := range []string{"many-headers", "big-header"} {
		got := h.rawDo(t, "GET", "/s/sbx-a/provider/"+op, []string{auth}, "")
		require.Equal(t, http.StatusBadGateway, got.status, op)
		require.Empty(t, got.header.Values("X-Big"))
		require.Empty(t, got.header.Values("X-Many-1"))
	}
	require.Equal(t, 2, h.denials(t, "response_headers_too_large"))
	require.Equal(t, http.StatusOK, h.rawDo(t, "GET", "/s/sbx-a/provider/x", []string{auth}, "").status, "the proxy keeps serving")
}
