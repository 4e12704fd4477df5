// Package gitrepo parses the HTTPS repository URLs a session may name and
// maps them to the credential proxy's git route, /git/<host>/<path>: the
// wrapper (which clones through it), the proxy (which admits only the
// session's repository) and the session service (which validates the URL)
// read a URL the same way.
package gitrepo

import (
	"errors"
	"net/url"
	"strings"
)

// ErrBadRepoURL is a repository URL the git route cannot serve.
var ErrBadRepoURL = errors.New("gitrepo: repository URL must be http(s)://host/path without credentials, query or fragment")

// Repo is a parsed repository URL.
type Repo struct {
	Scheme string // http or https
	Host   string // host[:port], lower case
	Path   string // "/org/repo.git", no trailing slash
}

// Parse checks a repository URL: http or https, a host, a path of
// plain segments, no user info, query or fragment.
func Parse(raw string) (Repo, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.User != nil ||
		u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" || strings.ContainsAny(u.Host, "/\\@") {
		return Repo{}, ErrBadRepoURL
	}
	p := strings.TrimSuffix(u.Path, "/")
	if p == "" || u.RawPath != "" && u.RawPath != u.Path {
		return Repo{}, ErrBadRepoURL
	}
	for _, s := range strings.Split(p[1:], "/") {
		if s == "" || s == "." || s == ".." || strings.ContainsAny(s, "\\%") || hasControl(s) {
			return Repo{}, ErrBadRepoURL
		}
	}
	return Repo{Scheme: u.Scheme, Host: strings.ToLower(u.Host), Path: p}, nil
}

func hasControl(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] == 0x7f || s[i] == ' ' {
			return true
		}
	}
	return false
}

// ProxyPath is the repository's path under a sandbox's proxy base:
// /git/<host>/<path>.
func (r Repo) ProxyPath() string { return "/git/" + r.Host + r.Path }

// ProxyRemote is the repository's URL through the proxy (what .git/config
// names as origin: no secret in it).
func (r Repo) ProxyRemote(proxyURL string) string {
	return strings.TrimRight(proxyURL, "/") + r.ProxyPath()
}
