package proxy

import (
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
var credentialFragments = []string{"api-key", "apikey", "api_key", "auth-token", "access-token", "session-token"}

func connectionNamed(h http.Header) map[string]bool {
	named := map[string]bool{}
	for k, vs := range h {
		if strings.EqualFold(k, "connection") || strings.EqualFold(k, "proxy-connection") {
			for _, v := range vs {
				for f := range strings.SplitSeq(v, ",") {
					if f = strings.TrimSpace(f); f != "" {
						named[strings.ToLower(f)] = true
					}
				}
			}
		}
	}
	return named
}

// FilterRequest deletes every header a caller must not pass upstream. It
// matches names case-insensitively, also in maps not built by net/http.
func FilterRequest(h http.Header) {
	named := connectionNamed(h)
	for k := range h {
		n := strings.ToLower(k)
		if hopByHop[n] || named[n] || callerCredential[n] ||
			strings.HasPrefix(n, "x-forwarded-") || strings.HasPrefix(n, "x-agentplane-") || hasCredentialFragment(n) {
			delete(h, k)
		}
	}
}

func hasCredentialFragment(n string) bool {
	for _, f := range credentialFragments {
		if strings.Contains(n, f) {
			return true
		}
	}
	return false
}

// FilterResponse deletes cookies, hop-by-hop and agentplane headers
// (including the attestation) from an upstream response.
func FilterResponse(h http.Header) {
	named := connectionNamed(h)
	for k := range h {
		n := strings.ToLower(k)
		if hopByHop[n] || named[n] || n == "set-cookie" || n == "set-cookie2" || strings.HasPrefix(n, "x-agentplane-") {
			delete(h, k)
		}
	}
}
