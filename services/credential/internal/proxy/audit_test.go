package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
)

type auditSink struct {
	mu      sync.Mutex
	reports []AuditReport
}

func (s *auditSink) RecordRequest(r AuditReport) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reports = append(s.reports, r)
}

func (s *auditSink) waitFor(t *testing.T, n int) []AuditReport {
	t.Helper()
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.reports) >= n
	}, 10*time.Second, 5*time.Millisecond)
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.reports
	s.reports = nil
	return out
}

// Every provider request whose handle resolved is reported once its
// response ended: route, method, a path template (no id, no query),
// status, body bytes each way and the runtime key of the handle; requests
// refused before their handle resolved and ingest requests are not.
func TestProxyRequestsAreAudited(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		if strings.Contains(r.URL.Path, "missing") {
			w.WriteHeader(http.StatusNotFound)
		}
		_, _ = io.WriteString(w, `{"ok":true}`)
	}))
	t.Cleanup(up.Close)
	raw, err := handle.New(handle.Worktree)
	require.NoError(t, err)
	res := &grants.Resolved{Secret: []byte("sk-backing"), Member: scope.Member{UserID: "u1", SessionID: "s1", RuntimeSessionID: "rs-1"}}
	res.Grant.Kind = handle.Worktree
	res.Grant.Scope = scope.Scope{SandboxID: "sbx-a", Directory: "/w"}
	provider, _ := url.Parse(up.URL + "/v1")
	sink := &auditSink{}
	p, err := New(Config{Resolver: fixedResolver{raw: raw, res: res}, ProviderUpstream: provider,
		AttestationKey: []byte(strings.Repeat("k", 32)), Audit: sink})
	require.NoError(t, err)
	t.Cleanup(p.Close)
	srv := httptest.NewServer(p.Handler())
	t.Cleanup(srv.Close)
	do := func(method, path, body string, auth bool) int {
		req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		if auth {
			req.Header.Set("Authorization", "Bearer "+raw)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		_, _ = io.ReadAll(resp.Body)
		return resp.StatusCode
	}

	require.Equal(t, http.StatusOK, do(http.MethodPost, "/s/sbx-a/provider/chat/completions?key=sk-in-query", `{"model":"m"}`, true))
	require.Equal(t, http.StatusNotFound, do(http.MethodGet, "/s/sbx-a/provider/models/Secret-Model-7f3a/missing", "", true))
	require.Equal(t, http.StatusUnauthorized, do(http.MethodGet, "/s/sbx-a/provider/models", "", false)) // no handle: not audited
	require.Equal(t, http.StatusOK, do(http.MethodGet, "/s/sbx-a/provider/models", "", true))
	got := sink.waitFor(t, 3)
	require.Len(t, got, 3)
	for _, r := range got {
		require.Equal(t, "s1", r.SessionID)
		require.Equal(t, "sbx-a", r.SandboxID)
		require.Equal(t, "rs-1", r.RuntimeSessionID)
		require.Equal(t, "/w", r.RuntimeKey, "a worktree handle serves the directory's runtime")
		require.Equal(t, RouteProvider, r.Route)
		require.False(t, r.Start.IsZero())
		require.NotContains(t, r.PathTemplate, "sk-in-query")
		require.NotContains(t, r.PathTemplate, "Secret-Model")
	}
	require.Equal(t, AuditReport{Method: "POST", PathTemplate: "chat/completions", Status: 200, BytesIn: 13, BytesOut: 11},
		AuditReport{Method: got[0].Method, PathTemplate: got[0].PathTemplate, Status: got[0].Status, BytesIn: got[0].BytesIn, BytesOut: got[0].BytesOut})
	require.Equal(t, "models/{id}/missing", got[1].PathTemplate)
	require.Equal(t, http.StatusNotFound, got[1].Status)
	require.Equal(t, "models", got[2].PathTemplate)
}

func TestPathTemplate(t *testing.T) {
	for _, c := range []struct {
		route Route
		rest  []string
		want  string
	}{
		{RouteProvider, []string{"chat", "completions"}, "chat/completions"},
		{RouteProvider, []string{"v1", "files", "file-abc123", "content"}, "v1/files/{id}/content"},
		{RouteProvider, []string{"models", "gpt-4o-mini"}, "models/{id}"},
		{RouteBackend, []string{"users", "42", "ABC"}, "users/{id}/{id}"},
		{RouteBackend, []string{"sk-live-0123456789"}, "{id}"},
		{RouteBackend, nil, ""},
		{RouteGit, []string{"github.com", "acme", "app.git", "info", "refs"}, "{repo}/info/refs"},
		{RouteGit, []string{"github.com", "acme", "app.git", "git-upload-pack"}, "{repo}/git-upload-pack"},
		{RouteGit, []string{"github.com", "acme", "app.git", "git-receive-pack"}, "{repo}/git-receive-pack"},
		{RouteGit, []string{"github.com", "acme", "secret"}, "{repo}"},
	} {
		require.Equal(t, c.want, PathTemplate(Target{Route: c.route, Rest: c.rest}), "%s %v", c.route, c.rest)
	}
	long := make([]string, 40)
	for i := range long {
		long[i] = "a"
	}
	require.Equal(t, strings.Repeat("a/", 16)+"…", PathTemplate(Target{Route: RouteBackend, Rest: long}))
}
