package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/pkg/gitrepo"
	"agentplane.dev/services/credential/internal/grants"
)

// GitCredentials opens a member's git credential (grants.Service).
type GitCredentials interface {
	GitCredential(ctx context.Context, ref string) (grants.GitAccess, error)
}

// The git route: /s/<sandbox>/git/<host>/<repo path>/<endpoint>, admitted
// only for the resolving member's repository (host and path exactly) and
// only for the smart-HTTP fetch and push endpoints. Its own allowlists of
// methods and request headers live here, apart from the other routes'.

// gitEndpoint is one admitted smart-HTTP endpoint.
type gitEndpoint struct {
	suffix []string
	method string
	query  func(string) bool
}

var gitEndpoints = []gitEndpoint{
	{[]string{"info", "refs"}, http.MethodGet, func(q string) bool {
		return q == "service=git-upload-pack" || q == "service=git-receive-pack"
	}},
	{[]string{"git-upload-pack"}, http.MethodPost, func(q string) bool { return q == "" }},
	{[]string{"git-receive-pack"}, http.MethodPost, func(q string) bool { return q == "" }},
}

// GitPolicy is the git route's method and request-header allowlist (the
// smart-HTTP client's). It is fixed, not configured: the endpoints are.
// Accept-Encoding is left out like on every route (the proxy reads every
// body it returns); Content-Encoding stays, git gzips large requests.
var GitPolicy = RoutePolicy{
	Methods: []string{http.MethodGet, http.MethodPost},
	Headers: []string{"Accept", "Accept-Language", "Content-Type", "Content-Encoding", "Content-Length",
		"Git-Protocol", "Pragma", "User-Agent"},
}

// gitUsername is the Basic user name sent with a token when the credential
// names none (what GitHub and most hosts accept for tokens).
const gitUsername = "x-access-token"

// matchGit splits rest (host, repo path segments, endpoint) against the
// member's repository. It returns the endpoint, or "" with a denial reason.
func matchGit(rest []string, repo gitrepo.Repo, method, query string) (*gitEndpoint, string) {
	if len(rest) < 2 || !strings.EqualFold(rest[0], repo.Host) {
		return nil, "git_repo_denied"
	}
	segs := strings.Split(strings.TrimPrefix(repo.Path, "/"), "/")
	tail := rest[1:]
	if len(tail) <= len(segs) {
		return nil, "git_repo_denied"
	}
	for i, s := range segs {
		if tail[i] != s {
			return nil, "git_repo_denied"
		}
	}
	suffix := tail[len(segs):]
	for i := range gitEndpoints {
		e := &gitEndpoints[i]
		if equalSegs(suffix, e.suffix) {
			if method != e.method {
				return nil, "method_not_allowed"
			}
			if !e.query(query) {
				return nil, "git_endpoint_denied"
			}
			return e, ""
		}
	}
	return nil, "git_endpoint_denied"
}

func equalSegs(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func (p *Proxy) serveGit(w http.ResponseWriter, r *http.Request, t Target, res *grants.Resolved) {
	acc, repo, ok := p.gitAccess(w, r, res)
	if !ok {
		return
	}
	ep, reason := matchGit(t.Rest, repo, r.Method, t.RawQuery)
	if reason != "" {
		if reason == "method_not_allowed" {
			p.deny(w, reason, http.StatusMethodNotAllowed, "method not allowed on this git endpoint")
			return
		}
		p.deny(w, reason, http.StatusForbidden, "only the session's repository fetch and push endpoints are admitted")
		return
	}
	body := io.Reader(r.Body)
	if ep.suffix[0] == "git-receive-pack" {
		if body, ok = p.checkPush(w, r, res, acc.PushPrefix); !ok {
			return
		}
	}
	out, guard := p.gitOutgoing(r, t, repo, acc, body)
	start := time.Now()
	err := p.gitFwd.forward(r.Context(), w, out, guard, nil)
	p.metrics.upstream.WithLabelValues(string(RouteGit)).Observe(time.Since(start).Seconds())
	switch {
	case err == nil:
		return
	case p.refuseResponse(w, err):
		return
	case errors.As(err, new(*egresspolicy.AddressError)):
		p.deny(w, "git_address_denied", http.StatusForbidden,
			"the repository's host resolves to a private, loopback, link-local or reserved address the git route does not dial")
		return
	}
	p.upstreamFailed(w, r, err, "git upstream failed", "host", repo.Host)
}

// gitAccess opens the resolving member's git credential and its
// repository; false when the request was denied (no credential, or none
// that can be served).
func (p *Proxy) gitAccess(w http.ResponseWriter, r *http.Request, res *grants.Resolved) (grants.GitAccess, gitrepo.Repo, bool) {
	ref := res.Member.GitCredentialRef
	if ref == "" {
		p.deny(w, "git_not_granted", http.StatusForbidden, "the session has no git credential")
		return grants.GitAccess{}, gitrepo.Repo{}, false
	}
	acc, err := p.cfg.Git.GitCredential(r.Context(), ref)
	if err != nil {
		p.cfg.Logger.WarnContext(r.Context(), "git credential unavailable", "error", err.Error())
		p.deny(w, "git_not_granted", http.StatusForbidden, "the session's git credential is unavailable")
		return grants.GitAccess{}, gitrepo.Repo{}, false
	}
	repo, err := gitrepo.Parse(acc.RepoURL)
	if err != nil {
		p.deny(w, "git_not_granted", http.StatusForbidden, "the session's repository is not servable")
		return grants.GitAccess{}, gitrepo.Repo{}, false
	}
	return acc, repo, true
}

// gitOutgoing builds the request to the repository's host: the caller's
// headers filtered to the git allowlist, the credential as Basic
// authorization (anonymous without a token), and the echo guard that
// refuses a response repeating it.
func (p *Proxy) gitOutgoing(r *http.Request, t Target, repo gitrepo.Repo, acc grants.GitAccess, body io.Reader) (*http.Request, echoGuard) {
	user := acc.Username
	if user == "" {
		user = gitUsername
	}
	h := r.Header
	FilterRequest(h)
	keepAllowed(h, p.routes[RouteGit])
	if _, ok := h["User-Agent"]; !ok {
		h.Set("User-Agent", "")
	}
	guard := newEchoGuard()
	if len(acc.Token) > 0 {
		basic := base64.StdEncoding.EncodeToString([]byte(user + ":" + string(acc.Token)))
		h.Set("Authorization", "Basic "+basic)
		guard = newEchoGuard(string(acc.Token), basic)
	} // else anonymous: a server that wants authentication answers 401 (repo_auth_failed)
	esc := make([]string, len(t.Rest)-1)
	for i, s := range t.Rest[1:] {
		esc[i] = url.PathEscape(s)
	}
	u := &url.URL{Scheme: repo.Scheme, Host: repo.Host, Path: "/" + strings.Join(t.Rest[1:], "/"),
		RawPath: "/" + strings.Join(esc, "/"), RawQuery: t.RawQuery}
	out := &http.Request{
		Method: r.Method, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Host: repo.Host,
		Header: h, Body: io.NopCloser(body), ContentLength: r.ContentLength,
	}
	if r.ContentLength == 0 {
		out.Body = nil
	}
	return out, guard
}

// basicHandle takes a handle sent as the Basic password (git with a
// credential helper answers the route's Basic challenge that way).
func basicHandle(r *http.Request) (string, bool) {
	_, pass, ok := r.BasicAuth()
	if !ok || pass == "" {
		return "", false
	}
	return pass, true
}

// maxRefusedDrain bounds what the route reads of a refused push's pack
// before answering (git sends the whole request before it reads the
// answer; past this the connection is closed instead).
const maxRefusedDrain = 64 << 20

// checkPush reads a receive-pack request's commands and checks them
// against the session's push policy. Admitted, it returns the body to
// forward (the bytes read, then the rest). Refused, it has answered the
// way receive-pack does, so git prints "! [remote rejected] <ref>
// (agentplane: <why>)", and the upstream saw nothing.
func (p *Proxy) checkPush(w http.ResponseWriter, r *http.Request, res *grants.Resolved, prefix string) (io.Reader, bool) {
	for _, ce := range r.Header.Values("Content-Encoding") {
		if !strings.EqualFold(strings.TrimSpace(ce), "identity") { // git never compresses a push
			p.deny(w, "git_push_encoded", http.StatusUnsupportedMediaType, "a push request body must not be compressed")
			return nil, false
		}
	}
	// The commands are read as sent and forwarded again ahead of the rest.
	br := bufio.NewReaderSize(r.Body, 64<<10)
	var seen bytes.Buffer
	req, err := ParsePush(io.TeeReader(br, &seen))
	switch {
	case errors.Is(err, errPushCert):
		p.deny(w, "git_push_cert_denied", http.StatusForbidden, "signed pushes are not admitted")
		return nil, false
	case err != nil:
		p.deny(w, "git_push_malformed", http.StatusBadRequest, "malformed push commands")
		return nil, false
	}
	msgs, reason := PushPolicy{BranchPrefix: prefix}.CheckAll(req.Commands)
	if msgs == nil {
		return io.MultiReader(&seen, br), true
	}
	refused := 0
	for i, m := range msgs {
		if m != "" {
			refused++
			p.cfg.Logger.WarnContext(r.Context(), "git push refused", "session", res.Member.SessionID,
				"sandbox", res.Grant.Scope.SandboxID, "ref", req.Commands[i].Ref, "reason", m)
		}
	}
	p.metrics.denials.WithLabelValues(reason).Inc()
	p.metrics.pushRefusals.Add(float64(refused))
	_, _ = io.Copy(io.Discard, io.LimitReader(br, maxRefusedDrain))
	w.Header().Set("Content-Type", "application/x-git-receive-pack-result")
	w.Header().Set("Cache-Control", "no-cache")
	if !req.Has("report-status") && !req.Has("report-status-v2") {
		w.WriteHeader(http.StatusForbidden) // a client that reads no report: only the status says it
		return nil, false
	}
	_, _ = w.Write(RefusalReport(req, msgs))
	return nil, false
}
