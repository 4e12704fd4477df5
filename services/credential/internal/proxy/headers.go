package proxy

import (
	"bytes"
	"net/http"
	"strings"
)

// hopByHop are the RFC 9110 connection-specific headers (plus the
// non-standard Proxy-Connection), never forwarded either way.
var hopByHop = map[string]bool{
	"connection": true, "proxy-connection": true, "keep-alive": true, "te": true, "trailer": true,
	"transfer-encoding": true, "upgrade": true, "proxy-authenticate": true, "proxy-authorization": true,
}

// callerCredential are request headers that carry a caller's credential or
// claim an identity; the proxy sets its own.
var callerCredential = map[string]bool{
	"authorization": true, "cookie": true, "cookie2": true,
	"forwarded": true, "x-real-ip": true, "x-client-ip": true, "true-client-ip": true,
	"x-cluster-client-ip": true, "via": true,
	"ocp-apim-subscription-key": true, "x-amz-security-token": true,
}

// credentialFragments catch API-key style headers by name: X-Api-Key,
// Api-Key, Openai-Api-Key, X-Goog-Api-Key, X-Auth-Token, ...
var credentialFragments = [][]byte{[]byte("api-key"), []byte("apikey"), []byte("api_key"), []byte("auth-token"), []byte("access-token"), []byte("session-token")}

// lowerName is name in lower case, in buf when it fits (a map lookup with
// string(b) does not allocate).
func lowerName(buf *[64]byte, name string) []byte {
	b := buf[:0]
	if len(name) > len(buf) {
		b = make([]byte, 0, len(name))
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		b = append(b, c)
	}
	return b
}

// connectionNamed returns the header names listed in Connection (nil, no
// allocation, when there is none).
func connectionNamed(h http.Header) map[string]bool {
	var named map[string]bool
	for k, vs := range h {
		if strings.EqualFold(k, "connection") || strings.EqualFold(k, "proxy-connection") {
			for _, v := range vs {
				for f := range strings.SplitSeq(v, ",") {
					if f = strings.TrimSpace(f); f != "" {
						if named == nil {
							named = map[string]bool{}
						}
						named[strings.ToLower(f)] = true
					}
				}
			}
		}
	}
	return named
}

// FilterRequest deletes every header a caller must not pass upstream
// whatever a route's allowlist says (the allowlist applies after it). It
// matches names case-insensitively, also in maps not built by net/http.
func FilterRequest(h http.Header) {
	named := connectionNamed(h)
	var buf [64]byte
	for k := range h {
		n := lowerName(&buf, k)
		if named[string(n)] || strippedName(n) {
			delete(h, k)
		}
	}
}

// strippedName reports whether a lower-case request header name is one the
// proxy always strips: hop-by-hop, a caller's credential or identity,
// x-forwarded-*, x-agentplane-*.
func strippedName(n []byte) bool {
	return hopByHop[string(n)] || callerCredential[string(n)] ||
		bytes.HasPrefix(n, xForwarded) || bytes.HasPrefix(n, xAgentplane) || hasCredentialFragment(n)
}

func stripped(lower string) bool { return strippedName([]byte(lower)) }

// keepAllowed deletes every header p does not allowlist.
func keepAllowed(h http.Header, p *RoutePolicy) {
	var buf [64]byte
	for k := range h {
		if !p.allowsHeader(lowerName(&buf, k)) {
			delete(h, k)
		}
	}
}

// Header bounds, both ways (docs/credential.md). A caller's request beyond
// them is 431 before anything else is looked at; an upstream's response
// beyond them is refused with 502. The HTTP server's own MaxHeaderBytes
// (maxHeadBytes) cuts off a larger request head before the handler runs.
const (
	MaxRequestHeaders      = 100
	MaxRequestHeaderBytes  = 32 << 10
	MaxResponseHeaders     = 200
	MaxResponseHeaderBytes = 64 << 10
	// MaxHeadBytes is the http.Server MaxHeaderBytes for the proxy.
	MaxHeadBytes = 64 << 10
)

// headerSize returns the number of header fields in h and their size as
// sent (name, ": ", value, CRLF).
func headerSize(h http.Header) (fields, bytes int) {
	for k, vs := range h {
		for _, v := range vs {
			fields++
			bytes += len(k) + len(v) + 4
		}
	}
	return fields, bytes
}

var (
	xForwarded  = []byte("x-forwarded-")
	xAgentplane = []byte("x-agentplane-")
)

func hasCredentialFragment(n []byte) bool {
	for _, f := range credentialFragments {
		if bytes.Contains(n, f) {
			return true
		}
	}
	return false
}

// FilterResponse deletes cookies, hop-by-hop and agentplane headers
// (including the attestation) from an upstream response.
func FilterResponse(h http.Header) {
	named := connectionNamed(h)
	var buf [64]byte
	for k := range h {
		n := lowerName(&buf, k)
		if hopByHop[string(n)] || named[string(n)] || string(n) == "set-cookie" || string(n) == "set-cookie2" || bytes.HasPrefix(n, xAgentplane) {
			delete(h, k)
		}
	}
}
