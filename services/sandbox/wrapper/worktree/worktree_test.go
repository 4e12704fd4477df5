package worktree

import (
	"context"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/gittest"
	"agentplane.dev/pkg/testaddr"
)

const testHandle = "aph_test-handle"

// fakeProxy stands in for the credential proxy's git route: it requires
// the handle as bearer and forwards /s/sb/git/<host>/<path> to upstream
// with token as the Basic password. (The real route is tested in the
// credential service and end to end.)
func fakeProxy(t *testing.T, upstream, token string) string {
	u, err := url.Parse(upstream)
	require.NoError(t, err)
	rp := &httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) {
		rest := strings.TrimPrefix(pr.In.URL.Path, "/s/sb/git/"+u.Host)
		pr.Out.URL.Scheme, pr.Out.URL.Host, pr.Out.URL.Path, pr.Out.URL.RawPath = u.Scheme, u.Host, rest, ""
		pr.Out.Host = u.Host
		pr.Out.Header.Del("Authorization")
		pr.Out.SetBasicAuth("x-access-token", token)
	}}
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+testHandle {
			http.Error(w, "no handle", http.StatusUnauthorized)
			return
		}
		rp.ServeHTTP(w, r)
	}))
	return srv + "/s/sb"
}

func newServer(t *testing.T, h http.Handler) string {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	ln := testaddr.Listen(t)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String()
}

func spec(dir, repo, proxy string) Spec {
	return Spec{Dir: dir, RepoURL: repo, ProxyURL: proxy, Handle: func() string { return testHandle }}
}

type steps struct {
	mu   sync.Mutex
	seen []string
}

func (s *steps) add(step, detail string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seen = append(s.seen, step+": "+detail)
}

func TestCloneChangesPush(t *testing.T) {
	ctx := context.Background()
	g := gittest.Start(t, "tok-secret-1")
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n", "src/main.go": "package main\n"})
	proxy := fakeProxy(t, g.URL, g.Token)
	dir := filepath.Join(t.TempDir(), "ws")
	var st steps
	warm, err := Prepare(ctx, spec(dir, g.RepoURL("org/app.git"), proxy), st.add)
	require.NoError(t, err)
	require.False(t, warm)
	require.FileExists(t, filepath.Join(dir, "README.md"))
	require.FileExists(t, filepath.Join(dir, ".git", Marker))
	require.NotEmpty(t, st.seen)
	cfg, err := os.ReadFile(filepath.Join(dir, ".git", "config"))
	require.NoError(t, err)
	require.Contains(t, string(cfg), proxy+"/git/")
	require.NotContains(t, string(cfg), g.Token)
	require.NotContains(t, string(cfg), testHandle)

	warm, err = Prepare(ctx, spec(dir, g.RepoURL("org/app.git"), proxy), st.add)
	require.NoError(t, err)
	require.True(t, warm, "a complete clone is reused")

	require.NoError(t, os.WriteFile(filepath.Join(dir, "README.md"), []byte("hello world\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "NEW.txt"), []byte("new\n"), 0o644))
	require.NoError(t, os.Remove(filepath.Join(dir, "src/main.go")))
	ch, err := Report(ctx, dir, 1<<20)
	require.NoError(t, err)
	require.Equal(t, []FileChange{{"NEW.txt", Added}, {"README.md", Modified}, {"src/main.go", Deleted}}, ch.Files)
	require.Contains(t, ch.Diff, "+hello world")
	require.Len(t, ch.Head, 40)
	small, err := Report(ctx, dir, 10)
	require.NoError(t, err)
	require.True(t, small.Truncated)
	require.Len(t, small.Diff, 10)

	res, err := Push(ctx, PushSpec{Dir: dir, RepoURL: g.RepoURL("org/app.git"), ProxyURL: proxy,
		Handle: func() string { return testHandle }, Branch: "agent/one", Message: "agent change"})
	require.NoError(t, err)
	require.True(t, res.Committed)
	require.Equal(t, "refs/heads/agent/one", res.Ref)
	out := gittest.Run(t, filepath.Join(g.Root, "org/app.git"), "rev-parse", "refs/heads/agent/one")
	require.Equal(t, res.Commit, strings.TrimSpace(out))
	after, err := Report(ctx, dir, 1<<20)
	require.NoError(t, err)
	require.Empty(t, after.Files, "pushed changes are committed")

	// A second worktree pushes to the same branch from the old base: rejected.
	other := filepath.Join(t.TempDir(), "ws2")
	_, err = Prepare(ctx, spec(other, g.RepoURL("org/app.git"), proxy), st.add)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(other, "x.txt"), []byte("x\n"), 0o644))
	_, err = Push(ctx, PushSpec{Dir: other, RepoURL: g.RepoURL("org/app.git"), ProxyURL: proxy,
		Handle: func() string { return testHandle }, Branch: "agent/one", Message: "conflicting"})
	require.Equal(t, PushRejected, AsFailure(err, "").Reason, "%v", err)

	_, err = Push(ctx, PushSpec{Dir: other, RepoURL: g.RepoURL("org/app.git"), ProxyURL: proxy,
		Handle: func() string { return testHandle }, Branch: "bad..name", Message: "m"})
	require.Equal(t, InvalidBranch, AsFailure(err, "").Reason)
}

// TestPushAuthor: a push names the commit's author; the committer stays
// agentplane, and without an author the commit is agentplane's.
func TestPushAuthor(t *testing.T) {
	ctx := context.Background()
	g := gittest.Start(t, "tok-secret-author")
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n"})
	proxy := fakeProxy(t, g.URL, g.Token)
	dir := filepath.Join(t.TempDir(), "ws")
	_, err := Prepare(ctx, spec(dir, g.RepoURL("org/app.git"), proxy), func(string, string) {})
	require.NoError(t, err)
	remote := filepath.Join(g.Root, "org/app.git")
	push := func(branch, name, email string) string {
		require.NoError(t, os.WriteFile(filepath.Join(dir, branch+".txt"), []byte(branch+"\n"), 0o644))
		res, err := Push(ctx, PushSpec{Dir: dir, RepoURL: g.RepoURL("org/app.git"), ProxyURL: proxy,
			Handle: func() string { return testHandle }, Branch: "agent/" + branch, Message: "change",
			AuthorName: name, AuthorEmail: email})
		require.NoError(t, err)
		require.True(t, res.Committed)
		return strings.TrimSpace(gittest.Run(t, remote, "log", "-1", "--format=%an <%ae> / %cn <%ce>", res.Commit))
	}
	require.Equal(t, "Ada Lovelace <ada@example.com> / agentplane <agentplane@localhost>", push("a", "Ada Lovelace", "ada@example.com"))
	require.Equal(t, "agentplane <agentplane@localhost> / agentplane <agentplane@localhost>", push("b", "", ""))
	require.Equal(t, "Bob <agentplane@localhost> / agentplane <agentplane@localhost>", push("c", "Bob", ""))
}

func TestCloneFailuresLeaveNothingBehind(t *testing.T) {
	ctx := context.Background()
	g := gittest.Start(t, "tok-secret-2")
	bare := g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n"})
	big := make([]byte, 3<<20)
	for i := range big {
		big[i] = byte(i*7919 + i/3)
	}
	work := t.TempDir()
	gittest.Run(t, "", "clone", "-q", bare, work)
	require.NoError(t, os.WriteFile(filepath.Join(work, "blob.bin"), big, 0o644))
	gittest.Run(t, work, "add", "-A")
	gittest.Run(t, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "big")
	gittest.Run(t, work, "push", "-q", "origin", "main")
	good := fakeProxy(t, g.URL, g.Token)

	cases := map[string]struct {
		spec   func(dir string) Spec
		reason string
	}{
		"missing ref": {func(d string) Spec {
			s := spec(d, g.RepoURL("org/app.git"), good)
			s.Ref = "no-such-branch"
			return s
		}, ReasonRefNotFound},
		"missing commit": {func(d string) Spec {
			s := spec(d, g.RepoURL("org/app.git"), good)
			s.Ref = "0123456789abcdef0123456789abcdef01234567"
			return s
		}, ReasonRefNotFound},
		"wrong token":        {func(d string) Spec { return spec(d, g.RepoURL("org/app.git"), fakeProxy(t, g.URL, "wrong")) }, ReasonRepoAuthFailed},
		"no such repository": {func(d string) Spec { return spec(d, g.RepoURL("org/none.git"), good) }, ReasonRepoUnreachable},
		"unreachable host": {func(d string) Spec {
			return spec(d, "http://"+testaddr.Addr(t)+"/org/app.git", fakeProxy(t, "http://"+testaddr.Addr(t), "x"))
		}, ReasonRepoUnreachable},
		"too large": {func(d string) Spec {
			s := spec(d, g.RepoURL("org/app.git"), good)
			s.MaxBytes = 1 << 20
			return s
		}, ReasonRepoTooLarge},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ws")
			_, err := Prepare(ctx, c.spec(dir), func(string, string) {})
			require.Error(t, err)
			require.Equal(t, c.reason, AsFailure(err, "").Reason, "%v", err)
			entries, _ := os.ReadDir(dir)
			require.Empty(t, entries, "nothing half-cloned stays behind")
		})
	}

	t.Run("half clone is wiped, not reused", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "ws")
		require.NoError(t, os.MkdirAll(filepath.Join(dir, ".git"), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "partial"), []byte("x"), 0o644))
		warm, err := Prepare(ctx, spec(dir, g.RepoURL("org/app.git"), good), func(string, string) {})
		require.NoError(t, err)
		require.False(t, warm)
		require.NoFileExists(t, filepath.Join(dir, "partial"))
		require.FileExists(t, filepath.Join(dir, "blob.bin"))
	})
	t.Run("depth and branch", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "ws")
		s := spec(dir, g.RepoURL("org/app.git"), good)
		s.Ref, s.Depth = "main", 1
		_, err := Prepare(ctx, s, func(string, string) {})
		require.NoError(t, err)
		require.Equal(t, "1", strings.TrimSpace(gittest.Run(t, dir, "rev-list", "--count", "HEAD")))
	})
}
