package server

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/pkg/gittest"
)

var wtContract = credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE

// mintGit mints a handle whose member carries a git credential for repoURL.
func (h *harness) mintGit(t *testing.T, sandbox, dir, session, repoURL, token string) string {
	return h.mintGitPrefix(t, sandbox, dir, session, repoURL, token, "")
}

// mintGitPrefix is mintGit with the credential's push branch prefix.
func (h *harness) mintGitPrefix(t *testing.T, sandbox, dir, session, repoURL, token, prefix string) string {
	ref := h.put(t, session, "sk-"+session, credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC)
	git, err := h.client.PutBackingCredential(bg, &credentialv1.PutBackingCredentialRequest{
		SessionId: session, CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: token, RepoUrl: repoURL,
		GitPushBranchPrefix: prefix,
	})
	require.NoError(t, err)
	resp, err := h.client.MintHandle(bg, &credentialv1.MintHandleRequest{
		Scope: &credentialv1.Scope{SandboxId: sandbox, Directory: dir}, Member: member(session), CredentialRef: ref,
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Contract: wtContract, FenceToken: 7,
		AllocationId: "alloc-1", GitCredentialRef: git.GetCredentialRef(),
	})
	require.NoError(t, err)
	return resp.GetHandle()
}

// TestProxyGitRoute: the git route admits the member's repository only
// (fetch and push endpoints), adds the token, and refuses another
// repository on the same host, another host, and a push to a repository
// the session did not name, each with 403 and a counted denial.
func TestProxyGitRoute(t *testing.T) {
	h := startHarness(t)
	token := "ghs_gitroute-token-1"
	a := gittest.Start(t, token)
	b := gittest.Start(t, token)
	a.CreateRepo(t, "org/app.git", map[string]string{"README.md": "app\n"})
	a.CreateRepo(t, "org/other.git", map[string]string{"README.md": "other\n"})
	b.CreateRepo(t, "org/app.git", map[string]string{"README.md": "b\n"})
	handle := h.mintGit(t, "sbx-git", "/w/app", "s-git", a.RepoURL("org/app.git"), token)
	noGit := h.mint(t, "sbx-git2", "/w/app", "s-nogit", "sk-x", wtContract, 7)
	hostA, hostB := strings.TrimPrefix(a.URL, "http://"), strings.TrimPrefix(b.URL, "http://")
	base := "/s/sbx-git/git/"

	// Admitted: the smart-HTTP advertisement, then a real clone and push
	// by git through the proxy.
	resp := h.do(t, "GET", base+hostA+"/org/app.git/info/refs?service=git-upload-pack", handle, http.Header{"Cookie": {"c=1"}, "X-Api-Key": {"k"}}, nil)
	body, _ := io.ReadAll(resp.Body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	require.Contains(t, string(body), "# service=git-upload-pack")
	require.NotContains(t, string(body), token)
	work := filepath.Join(t.TempDir(), "clone")
	gitThrough(t, "", handle, "clone", "-q", h.proxyURL+base+hostA+"/org/app.git", work)
	require.FileExists(t, filepath.Join(work, "README.md"))
	require.NoError(t, os.WriteFile(filepath.Join(work, "x.txt"), []byte("x\n"), 0o644))
	gittest.Run(t, work, "add", "-A")
	gittest.Run(t, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
	gitThrough(t, work, handle, "push", "-q", "origin", "HEAD:refs/heads/agent/pushed")
	gittest.Run(t, filepath.Join(a.Root, "org/app.git"), "rev-parse", "refs/heads/agent/pushed")
	for _, r := range a.Log() {
		require.True(t, r.Authorized, "every request the proxy forwarded carried the token: %+v", r)
	}
	seenA, seenB := len(a.Log()), len(b.Log())

	// Refused, none reaching a git server.
	refused := []struct {
		method, path string
		code         int
	}{
		{"GET", hostA + "/org/other.git/info/refs?service=git-upload-pack", 403},    // another repo, same host
		{"GET", hostB + "/org/app.git/info/refs?service=git-upload-pack", 403},      // another host
		{"GET", hostA + "/org/other.git/info/refs?service=git-receive-pack", 403},   // push to a repo not named
		{"POST", hostA + "/org/other.git/git-receive-pack", 403},                    // push to a repo not named
		{"GET", hostA + "/org/app.git/objects/info/packs", 403},                     // dumb protocol
		{"GET", hostA + "/org/app.git/info/refs?service=git-upload-archive", 403},   // other service
		{"GET", hostA + "/org/app.git/git-upload-pack", 405},                        // wrong method
		{"GET", hostA + "/org/app.git.evil/info/refs?service=git-upload-pack", 403}, // lookalike path
		{"GET", hostA + "/org/app.git/sub/info/refs?service=git-upload-pack", 403},  // deeper path
	}
	for _, c := range refused {
		resp := h.do(t, c.method, base+c.path, handle, nil, nil)
		require.Equal(t, c.code, resp.StatusCode, "%s %s", c.method, c.path)
	}
	resp = h.do(t, "GET", "/s/sbx-git2/git/"+hostA+"/org/app.git/info/refs?service=git-upload-pack", noGit.handle, nil, nil)
	require.Equal(t, http.StatusForbidden, resp.StatusCode, "a member without a git credential")
	resp = h.do(t, "GET", base+hostA+"/org/app.git/info/refs?service=git-upload-pack", "", nil, nil)
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	require.Len(t, a.Log(), seenA, "nothing refused reached host A")
	require.Len(t, b.Log(), seenB, "nothing reached host B")

	resp, err := h.http.Get(h.metrics)
	require.NoError(t, err)
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, reason := range []string{"git_repo_denied", "git_endpoint_denied", "method_not_allowed", "git_not_granted"} {
		require.Contains(t, string(metrics), `agentplane_credential_proxy_denials_total{reason="`+reason+`"}`)
	}
}

// gitThrough runs the test's own git against the proxy with the handle as
// bearer (the test is the caller here, not a sandbox).
func gitThrough(t *testing.T, dir, handle string, args ...string) {
	t.Helper()
	out, err := gitThroughErr(dir, handle, args...)
	require.NoError(t, err, "git %v: %s", args, out)
}

// gitThroughErr is gitThrough returning git's output and error.
func gitThroughErr(dir, handle string, args ...string) (string, error) {
	cmd := exec.Command("git", append([]string{"-c", "http.extraHeader=Authorization: Bearer " + handle}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_TERMINAL_PROMPT=0", "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestProxyGitRouteRefusesPrivateAddresses: without
// PROXY_GIT_PRIVATE_NETWORKS (the default) the git route dials no
// private, loopback or link-local address, whatever form the session's
// repository URL names it in (a name that resolves to one, an IPv4 or
// IPv6 literal): each is refused with 403 and git_address_denied, and
// nothing reaches the git server.
func TestProxyGitRouteRefusesPrivateAddresses(t *testing.T) {
	h := startHarness(t, func(c *Config) { c.GitNetworks = "" })
	token := "ghs_gitroute-token-2"
	a := gittest.Start(t, token)
	a.CreateRepo(t, "org/app.git", map[string]string{"README.md": "app\n"})
	hostPort := strings.TrimPrefix(a.URL, "http://")
	_, port, err := net.SplitHostPort(hostPort)
	require.NoError(t, err)
	for i, host := range []string{hostPort, "localhost:" + port, "[::ffff:127.0.0.1]:" + port} {
		sandbox := fmt.Sprintf("sbx-gitaddr%d", i)
		handle := h.mintGit(t, sandbox, "/w/app", "s-gitaddr"+strconv.Itoa(i), "http://"+host+"/org/app.git", token)
		resp := h.do(t, "GET", "/s/"+sandbox+"/git/"+host+"/org/app.git/info/refs?service=git-upload-pack", handle, nil, nil)
		body, _ := io.ReadAll(resp.Body)
		require.Equal(t, http.StatusForbidden, resp.StatusCode, "%s: %s", host, body)
		require.Contains(t, string(body), "private, loopback, link-local or reserved address", host)
	}
	require.Empty(t, a.Log(), "nothing reached the git server")
	resp, err := h.http.Get(h.metrics)
	require.NoError(t, err)
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(metrics), `agentplane_credential_proxy_denials_total{reason="git_address_denied"} 3`)
}
