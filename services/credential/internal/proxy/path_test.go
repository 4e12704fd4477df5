package proxy

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseTargetRefuses(t *testing.T) {
	for _, uri := range []string{
		"/s/sb/provider/../x", "/s/sb/provider/a/..", "/s/sb/provider/./x", "/s/sb/../provider/x", "/s/../sb/provider",
		"/s/sb//provider/x", "/s/sb/provider//x", "//s/sb/provider/x", "/s/sb/provider/x//",
		"/s/sb/provider\\x", "/s/sb/provider/a\\..\\b",
		"/s/sb/provider/a%2fb", "/s/sb/provider/a%2Fb", "/s/sb/provider/a%5cb", "/s/sb/provider/a%5Cb",
		"/s/sb/provider/%2e%2e/x", "/s/sb/provider/%2E%2E/x", "/s/sb/provider/%2e/x", "/s/sb/provider/.%2e/x",
		"/s/sb/provider/%252f", "/s/sb/provider/%252e%252e", "/s/sb/provider/%25", "/s/sb/provider/%25%32%66",
		"/s/sb/provider/%00", "/s/sb/provider/%0a", "/s/sb/provider/a\x00b", "/s/sb/provider/%zz", "/s/sb/provider/%2",
		"relative/path", "http://evil.example/s/sb/provider/x", "*", "",
	} {
		_, err := ParseTarget(uri)
		require.ErrorIs(t, err, ErrBadPath, "%q", uri)
	}
}

func TestParseTargetRoutes(t *testing.T) {
	for _, uri := range []string{"/", "/s", "/s/sb", "/s/sb/other/x", "/x/sb/provider/x", "/s/b@d/provider/x", "/s/sb/Provider/x", "/healthz"} {
		_, err := ParseTarget(uri)
		require.ErrorIs(t, err, ErrNoRoute, "%q", uri)
	}
	tg, err := ParseTarget("/s/sbx-1/provider/v1/chat/completions?stream=true&a=%2F")
	require.NoError(t, err)
	require.Equal(t, Target{SandboxID: "sbx-1", Route: RouteProvider, Rest: []string{"v1", "chat", "completions"}, RawQuery: "stream=true&a=%2F"}, tg)
	tg, err = ParseTarget("/s/sbx-1/backend/files/a%20b")
	require.NoError(t, err)
	require.Equal(t, []string{"files", "a b"}, tg.Rest)
	tg, err = ParseTarget("/s/sbx-1/ingest/v1/sessions/rs-1/items")
	require.NoError(t, err)
	require.Equal(t, RouteIngest, tg.Route)
}

func FuzzParseTarget(f *testing.F) {
	for _, s := range []string{"/s/sb/provider/v1/chat", "/s/sb/provider/%2e%2e/x", "/s/sb/backend/a%20b?x=1", "/s/sb//x", "/s/sb/provider/%252f"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, uri string) {
		tg, err := ParseTarget(uri)
		if err != nil {
			return
		}
		path, _, _ := strings.Cut(uri, "?")
		if strings.Contains(path, "//") || strings.Contains(path, "\\") {
			t.Fatalf("accepted a path with an empty segment or backslash")
		}
		for _, s := range append([]string{tg.SandboxID}, tg.Rest...) {
			if s == "." || s == ".." || strings.ContainsAny(s, "/\\%") {
				t.Fatalf("accepted segment %q", s)
			}
			for i := 0; i < len(s); i++ {
				if s[i] < 0x20 || s[i] == 0x7f {
					t.Fatalf("accepted a control byte")
				}
			}
		}
	})
}

// strippedRequest lists every header a caller must not get upstream; each is
// sent in several spellings.
var strippedRequest = []string{
	"Authorization", "Proxy-Authorization", "Cookie", "Cookie2",
	"X-Api-Key", "Api-Key", "Openai-Api-Key", "X-Goog-Api-Key", "Anthropic-Api-Key", "X-Apikey", "Apikey", "X-Auth-Token", "X-Access-Token",
	"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "X-Forwarded-Port", "X-Real-Ip", "X-Client-Ip", "True-Client-Ip", "Via",
	"Connection", "Proxy-Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
	"X-Agentplane-Sandbox", "X-Agentplane-Attestation", "X-Agentplane-User",
}

func spellings(name string) []string {
	mixed := []byte(strings.ToLower(name))
	for i := range mixed {
		if i%2 == 1 {
			mixed[i] = strings.ToUpper(string(mixed[i]))[0]
		}
	}
	return []string{name, strings.ToLower(name), strings.ToUpper(name), string(mixed)}
}

func TestFilterRequestTable(t *testing.T) {
	for _, name := range strippedRequest {
		for _, sp := range spellings(name) {
			h := http.Header{sp: {"v"}, "Content-Type": {"application/json"}, "X-Keep": {"1"}}
			FilterRequest(h)
			require.Equal(t, http.Header{"Content-Type": {"application/json"}, "X-Keep": {"1"}}, h, "%s", sp)
		}
	}
	h := http.Header{"cOnNeCtIoN": {"x-Custom-Hop, keep-alive"}, "X-Custom-Hop": {"1"}, "Accept": {"*/*"}}
	FilterRequest(h)
	require.Equal(t, http.Header{"Accept": {"*/*"}}, h, "headers named in Connection go too")
}

func TestFilterResponse(t *testing.T) {
	h := http.Header{
		"Set-Cookie": {"a=b"}, "set-cookie2": {"c"}, "Connection": {"X-Hop"}, "X-Hop": {"1"}, "Keep-Alive": {"5"},
		"X-Agentplane-Attestation": {"forged"}, "Transfer-Encoding": {"chunked"}, "Content-Type": {"text/plain"},
	}
	FilterResponse(h)
	require.Equal(t, http.Header{"Content-Type": {"text/plain"}}, h)
}

func FuzzFilterRequest(f *testing.F) {
	f.Add("X-Api-Key", "v", "x-custom")
	f.Add("Connection", "X-Foo, Upgrade", "X-Foo")
	f.Add("x-forwarded-for", "1.2.3.4", "Accept")
	f.Fuzz(func(t *testing.T, name, value, other string) {
		h := http.Header{name: {value}, other: {"1"}}
		FilterRequest(h)
		for k := range h {
			n := strings.ToLower(k)
			if n == "authorization" || n == "cookie" || n == "forwarded" || strings.HasPrefix(n, "x-forwarded-") ||
				strings.HasPrefix(n, "x-agentplane-") || strings.Contains(n, "api-key") || hopByHop[n] {
				t.Fatalf("kept %q", k)
			}
		}
	})
}
