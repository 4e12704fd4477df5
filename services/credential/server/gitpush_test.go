package server

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/gittest"
)

// TestProxyGitPushPolicy: through the git route, git's own pushes that
// the session's push policy refuses (a force push to the default branch,
// a delete, a tag, a branch outside the prefix, and a push mixing an
// admitted and a refused ref) fail with receive-pack's report, so git
// prints "! [remote rejected] <ref> (agentplane: ...)"; none reaches the
// git server, whose refs are unchanged; each is counted. A create and a
// forced update of an agent/ branch go through, and a credential with its
// own prefix admits that prefix instead.
func TestProxyGitPushPolicy(t *testing.T) {
	h := startHarness(t)
	token := "ghs_pushpolicy-token-1"
	a := gittest.Start(t, token)
	a.CreateRepo(t, "org/app.git", map[string]string{"README.md": "app\n"})
	remote := filepath.Join(a.Root, "org/app.git")
	gittest.Run(t, remote, "branch", "keep")
	handle := h.mintGit(t, "sbx-push", "/w/app", "s-push", a.RepoURL("org/app.git"), token)
	host := strings.TrimPrefix(a.URL, "http://")
	url := h.proxyURL + "/s/sbx-push/git/" + host + "/org/app.git"

	work := filepath.Join(t.TempDir(), "clone")
	gitThrough(t, "", handle, "clone", "-q", url, work)
	gittest.Run(t, work, "checkout", "-q", "--orphan", "rewrite")
	require.NoError(t, os.WriteFile(filepath.Join(work, "README.md"), []byte("rewritten\n"), 0o644))
	gittest.Run(t, work, "add", "-A")
	gittest.Run(t, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "rewrite")
	refsBefore := gittest.Run(t, remote, "for-each-ref")
	seen := len(a.Log())

	refused := []struct {
		args []string
		want string
	}{
		{[]string{"push", "--force", "origin", "HEAD:main"}, "! [remote rejected] HEAD -> main (agentplane: only branches agent/* may be pushed)"},
		{[]string{"push", "origin", ":keep"}, "! [remote rejected] keep (agentplane: deleting a ref is not allowed)"},
		{[]string{"push", "origin", "HEAD:refs/tags/v1"}, "(agentplane: only branches agent/* may be pushed)"},
		{[]string{"push", "origin", "HEAD:feature"}, "(agentplane: only branches agent/* may be pushed)"},
		{[]string{"push", "origin", "HEAD:agent/ok", "+HEAD:main"}, "agent/ok (agentplane: another ref update of this push was refused)"},
	}
	for _, c := range refused {
		out, err := gitThroughErr(work, handle, c.args...)
		require.Error(t, err, "git %v: %s", c.args, out)
		require.Contains(t, out, c.want, "git %v", c.args)
		require.NotContains(t, out, token)
	}
	require.Equal(t, refsBefore, gittest.Run(t, remote, "for-each-ref"), "the remote's refs are unchanged")
	for _, r := range a.Log()[seen:] {
		require.NotContains(t, r.Path, "git-receive-pack", "no refused push reached the git server: %+v", r)
	}

	// Admitted: creating an agent/ branch, then a forced update of it.
	gitThrough(t, work, handle, "push", "-q", "origin", "HEAD:agent/x")
	require.Equal(t, gittest.Run(t, work, "rev-parse", "HEAD"), gittest.Run(t, remote, "rev-parse", "agent/x"))
	gittest.Run(t, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--amend", "-m", "amended")
	gitThrough(t, work, handle, "push", "-q", "--force", "origin", "HEAD:agent/x")
	require.Equal(t, gittest.Run(t, work, "rev-parse", "HEAD"), gittest.Run(t, remote, "rev-parse", "agent/x"))

	// A session's own prefix replaces agent/.
	bot := h.mintGitPrefix(t, "sbx-push2", "/w/app", "s-push2", a.RepoURL("org/app.git"), token, "bot/")
	url2 := h.proxyURL + "/s/sbx-push2/git/" + host + "/org/app.git"
	gittest.Run(t, work, "remote", "set-url", "origin", url2)
	gitThrough(t, work, bot, "push", "-q", "origin", "HEAD:bot/y")
	out, err := gitThroughErr(work, bot, "push", "origin", "HEAD:agent/y")
	require.Error(t, err)
	require.Contains(t, out, "(agentplane: only branches bot/* may be pushed)")

	resp, err := h.http.Get(h.metrics)
	require.NoError(t, err)
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(metrics), `agentplane_credential_proxy_denials_total{reason="git_push_ref_denied"} 5`)
	require.Contains(t, string(metrics), `agentplane_credential_proxy_denials_total{reason="git_push_delete_denied"} 1`)
	require.Contains(t, string(metrics), `agentplane_credential_proxy_git_push_refused_refs_total 6`)
}
