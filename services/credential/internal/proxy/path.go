package proxy

import (
	"errors"
	"strings"
)

// Route is the first path segment after the sandbox: which upstream serves
// the request.
type Route string

// Routes.
const (
	RouteProvider Route = "provider"
	RouteBackend  Route = "backend"
	RouteIngest   Route = "ingest"
	RouteGit      Route = "git"
)

// Errors of ParseTarget.
var (
	// ErrBadPath: traversal, empty segments, backslashes, encoded
	// separators or dots, double encoding, control characters (400).
	ErrBadPath = errors.New("proxy: refused path")
	// ErrNoRoute: a well-formed path that names no route (404).
	ErrNoRoute = errors.New("proxy: no such route")
)

// Target is a parsed proxy request path: /s/<sandbox-id>/<route>/<rest...>.
type Target struct {
	SandboxID string
	Route     Route
	Rest      []string // decoded segments after the route; never ".", ".." or containing '/'
	RawQuery  string
}

// ParseTarget normalizes a request URI (origin form, as sent on the request
// line). It refuses rather than cleans anything ambiguous, so the path the
// upstream sees is exactly the one that was checked.
func ParseTarget(requestURI string) (Target, error) {
	path, query, _ := strings.Cut(requestURI, "?")
	if !strings.HasPrefix(path, "/") || strings.Contains(path, "//") || strings.ContainsRune(path, '\\') {
		return Target{}, ErrBadPath
	}
	raw := strings.Split(path[1:], "/")
	segs := make([]string, len(raw))
	for i, r := range raw {
		s, err := decodeSegment(r)
		if err != nil {
			return Target{}, err
		}
		if s == "." || s == ".." {
			return Target{}, ErrBadPath
		}
		segs[i] = s
	}
	if len(segs) < 3 || segs[0] != "s" || !validSandboxID(segs[1]) {
		return Target{}, ErrNoRoute
	}
	t := Target{SandboxID: segs[1], Route: Route(segs[2]), Rest: segs[3:], RawQuery: query}
	switch t.Route {
	case RouteProvider, RouteBackend, RouteIngest, RouteGit:
		return t, nil
	}
	return Target{}, ErrNoRoute
}

// decodeSegment decodes percent escapes, refusing any that would decode to
// a separator, a dot, a percent sign (double encoding) or a control byte,
// and any raw control byte.
func decodeSegment(s string) (string, error) {
	if !strings.ContainsRune(s, '%') {
		for i := 0; i < len(s); i++ {
			if s[i] < 0x20 || s[i] == 0x7f {
				return "", ErrBadPath
			}
		}
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c == 0x7f {
			return "", ErrBadPath
		}
		if c != '%' {
			b.WriteByte(c)
			continue
		}
		if i+2 >= len(s) {
			return "", ErrBadPath
		}
		hi, ok1 := unhex(s[i+1])
		lo, ok2 := unhex(s[i+2])
		if !ok1 || !ok2 {
			return "", ErrBadPath
		}
		d := hi<<4 | lo
		switch {
		case d == '/', d == '\\', d == '.', d == '%', d < 0x20, d == 0x7f:
			return "", ErrBadPath
		}
		b.WriteByte(d)
		i += 2
	}
	return b.String(), nil
}

func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// validSandboxID admits the ids the sandbox service issues: 1 to 128 of
// [A-Za-z0-9._-], not "." or "..".
func validSandboxID(id string) bool {
	if id == "" || len(id) > 128 || id == "." || id == ".." {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}
