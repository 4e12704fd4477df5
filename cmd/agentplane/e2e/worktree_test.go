package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"
	"agentplane.dev/pkg/apierr/apierrtest"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/gittest"
	"agentplane.dev/pkg/testaddr"
	sandbox "agentplane.dev/services/sandbox/server"
)

// createGit makes a session on repoURL with a git token.
func (s *suite) createGit(t testing.TB, sandboxID, dir string, wt *sessionv1.Worktree, gitToken string) *sessionv1.Session {
	return s.createGitWith(t, sandboxID, dir, wt, &sessionv1.GitCredentialInput{Token: gitToken})
}

// createGitWith is createGit with the whole git credential input.
func (s *suite) createGitWith(t testing.TB, sandboxID, dir string, wt *sessionv1.Worktree, git *sessionv1.GitCredentialInput) *sessionv1.Session {
	wt.Directory = dir
	var out *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: sandboxID + "-" + s.run, Worktree: wt,
			Credential:    &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
			GitCredential: git,
		})
		out = resp.GetSession()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	return out
}

// listedFiles returns the names the turn's list_files reported.
func listedFiles(events []*sessionv1.SessionEvent) []string {
	var names []string
	for _, ev := range events {
		if re := ev.GetRuntimeEvent(); re != nil && re.GetToolName() == "list_files" && re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT {
			for _, n := range re.GetData().AsMap()["names"].([]any) {
				names = append(names, n.(string))
			}
		}
	}
	return names
}

func cloneRequests(g *gittest.Server) int {
	n := 0
	for _, r := range g.Log() {
		if strings.HasSuffix(r.Path, "/git-upload-pack") {
			n++
		}
	}
	return n
}

// TestWorktreeCloneChangesPush (issue 21): a session with a repository and
// a git token gets its worktree cloned through the proxy's git route; the
// runtime sees the files and changes one; GetWorktreeChanges shows the
// diff, a diff item is in the history, PushWorktree pushes a branch the
// test's own clone sees. The token is only ever on requests from the proxy
// and nowhere in the sandbox. A second session of the directory shares the
// checkout without a second clone.
func TestWorktreeCloneChangesPush(t *testing.T) {
	s := startSuite(t)
	token := "ghs_e2e" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n", "main.go": "package main\n"})
	dir := "/work/e2e-git"
	first := s.createGit(t, "sbx-git", dir, &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git")}, token)

	events := s.turn(t, first.GetSessionId(), "m1", "write: NOTES.md notes from the agent")
	require.ElementsMatch(t, []string{"README.md", "main.go"}, listedFiles(events), "the runtime sees the cloned files")
	var sawClone bool
	for _, ev := range events {
		if p := ev.GetProgress(); p != nil && (p.GetStep() == "clone" || p.GetStep() == "checkout") {
			sawClone = true
		}
	}
	require.True(t, sawClone, "clone progress was reported as route progress")
	clones := cloneRequests(g)
	require.Positive(t, clones)
	cfgs, _ := filepath.Glob(filepath.Join(s.root, "*", "workspaces", "*", ".git", "config"))
	require.Len(t, cfgs, 1)
	cfg, err := os.ReadFile(cfgs[0]) // the one workspace
	require.NoError(t, err)
	require.Contains(t, string(cfg), "/git/"+strings.TrimPrefix(g.URL, "http://")+"/org/app.git", "origin is the proxy's git route")
	require.NotContains(t, string(cfg), token)
	require.NotContains(t, string(cfg), "aph_", "no handle in .git/config")
	require.NotContains(t, string(cfg), "aps_", "no handle in .git/config")

	ctx := context.Background()
	ch, err := s.ses.GetWorktreeChanges(ctx, &sessionv1.GetWorktreeChangesRequest{SessionId: first.GetSessionId()})
	require.NoError(t, err)
	require.Len(t, ch.GetChanges().GetFiles(), 1)
	require.Equal(t, "NOTES.md", ch.GetChanges().GetFiles()[0].GetPath())
	require.Equal(t, runtimev1.FileChangeKind_FILE_CHANGE_KIND_ADDED, ch.GetChanges().GetFiles()[0].GetKind())
	require.Contains(t, ch.GetChanges().GetDiff(), "+notes from the agent")

	// The turn's change set is in the history as a diff item.
	rsid := s.routeView(t, first.GetSessionId()).GetRuntimeSessionId()
	require.Eventually(t, func() bool {
		resp, err := s.ing.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: rsid,
			Scope: &ingestv1.ScopeMetadata{Version: &ingestv1.ScopeMetadata_V1{V1: &ingestv1.ScopeV1{RuntimeSessionId: rsid}}}})
		if err != nil {
			return false
		}
		for _, it := range resp.GetItems() {
			if it.GetType() == ingestv1.ItemType_ITEM_TYPE_DIFF && it.GetItemId() == "diff-turn-m1" {
				var p struct {
					Files []struct{ Path, Kind string }
					Diff  string
				}
				return json.Unmarshal(it.GetPayload(), &p) == nil && len(p.Files) == 1 && p.Files[0].Path == "NOTES.md" &&
					strings.Contains(p.Diff, "+notes from the agent")
			}
		}
		return false
	}, 30*time.Second, 100*time.Millisecond, "a diff item was recorded after the turn")

	// A second session of the directory shares the checkout: it sees the
	// first's change, and nothing was cloned again.
	second := s.createGit(t, "sbx-git", dir, &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git")}, token)
	events = s.turn(t, second.GetSessionId(), "m1", "what is here")
	require.ElementsMatch(t, []string{"README.md", "main.go", "NOTES.md"}, listedFiles(events))
	require.Equal(t, clones, cloneRequests(g), "no second clone")

	pushed, err := s.ses.PushWorktree(ctx, &sessionv1.PushWorktreeRequest{SessionId: first.GetSessionId(), Branch: "agent/notes", CommitMessage: "Add notes"})
	require.NoError(t, err)
	require.True(t, pushed.GetCommitted())
	require.Equal(t, "refs/heads/agent/notes", pushed.GetRef())
	require.Len(t, pushed.GetCommitId(), 40)

	// The token was on every request the server got, and every request came
	// through the proxy: the sandbox has no other way to the server.
	for _, r := range g.Log() {
		require.True(t, r.Authorized, "%+v", r)
	}
	scanFiles(t, s.root, token)
	require.Positive(t, scanProcs(t, token))
	require.NotContains(t, s.logs.String(), token)

	// The test's own clone sees the pushed commit.
	own := filepath.Join(t.TempDir(), "own")
	gittest.Run(t, "", "clone", "-q", "--branch", "agent/notes", g.AuthURL("org/app.git"), own)
	require.Equal(t, pushed.GetCommitId(), strings.TrimSpace(gittest.Run(t, own, "rev-parse", "HEAD")))
	b, err := os.ReadFile(filepath.Join(own, "NOTES.md"))
	require.NoError(t, err)
	require.Equal(t, "notes from the agent\n", string(b))

	// Pushing the same branch from a stale base is refused with a reason.
	gittest.Run(t, own, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "moved on")
	gittest.Run(t, own, "push", "-q", "origin", "HEAD:refs/heads/agent/notes")
	_, err = s.ses.PushWorktree(ctx, &sessionv1.PushWorktreeRequest{SessionId: second.GetSessionId(), Branch: "agent/notes", CommitMessage: "again"})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "PUSH_REJECTED")
	_, err = s.ses.PushWorktree(ctx, &sessionv1.PushWorktreeRequest{SessionId: first.GetSessionId(), Branch: "bad..branch", CommitMessage: "m"})
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
}

// failedRoute sends a message and waits for the route to fail; it returns
// the route's reason and the message's.
func (s *suite) failedRoute(t *testing.T, sessionID string) (route, message string) {
	ctx := context.Background()
	_, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sessionID, MessageId: "m1", Content: "hi"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		m, err := s.ses.GetMessage(ctx, &sessionv1.GetMessageRequest{SessionId: sessionID, MessageId: "m1"})
		require.NoError(t, err)
		message = m.GetMessage().GetFailureReason()
		return m.GetMessage().GetState() == sessionv1.MessageState_MESSAGE_STATE_FAILED
	}, 60*time.Second, 100*time.Millisecond, "the queued message fails")
	return s.routeView(t, sessionID).GetFailureReason(), message
}

// TestWorktreeBadInput (issue 21): an unreachable repository, a wrong
// token, a missing ref and a repository over the size bound each fail the
// route with their named reason and fail the queued message; nothing
// half-cloned is left to be reused as warm.
func TestWorktreeBadInput(t *testing.T) {
	s := startSuiteWith(t, nil, func(c *sandbox.Config) { c.WrapperArgs = "--max-repo-bytes=1048576" })
	token := "ghs_bad" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n"})
	g.CreateRepo(t, "org/big.git", map[string]string{"README.md": "big\n"})
	work := t.TempDir()
	gittest.Run(t, "", "clone", "-q", filepath.Join(g.Root, "org/big.git"), work)
	big := make([]byte, 3<<20)
	for i := range big {
		big[i] = byte(i*7919 + i/3)
	}
	require.NoError(t, os.WriteFile(filepath.Join(work, "blob.bin"), big, 0o644))
	gittest.Run(t, work, "add", "-A")
	gittest.Run(t, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "big")
	gittest.Run(t, work, "push", "-q", "origin", "main")

	cases := []struct {
		name, dir string
		wt        *sessionv1.Worktree
		token     string
		reason    string
	}{
		{"unreachable", "/work/bad-unreach", &sessionv1.Worktree{RepoUrl: "http://" + closedAddr(t) + "/org/app.git"}, token, "repo_unreachable"},
		{"wrong token", "/work/bad-auth", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git")}, "wrong-token", "repo_auth_failed"},
		{"missing ref", "/work/bad-ref", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git"), Ref: "no-such-branch"}, token, "ref_not_found"},
		{"too large", "/work/bad-big", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/big.git")}, token, "repo_too_large"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sess := s.createGit(t, "sbx-bad-"+strings.ReplaceAll(c.name, " ", "-"), c.dir, c.wt, c.token)
			route, msg := s.failedRoute(t, sess.GetSessionId())
			require.Equal(t, c.reason, route)
			require.Equal(t, "route_failed", msg)
			// Nothing half-cloned: the workspace holds no .git.
			matches, _ := filepath.Glob(filepath.Join(s.root, "*", "workspaces", "*", ".git"))
			require.Empty(t, matches, "no clone left behind")
			if c.reason != "repo_unreachable" { // retryable: the route is prepared again
				// No agent runtime stays up for a route whose worktree
				// failed (the wrapper starts it after the clone).
				require.Eventually(t, func() bool {
					return len(runtimeProcesses(filepath.Join(s.root, sess.GetSandboxId()))) == 0
				}, 30*time.Second, 100*time.Millisecond, "a runtime left running in %s", sess.GetSandboxId())
			}
		})
	}
	scanFiles(t, s.root, token)
}

// runtimeProcesses lists the agent runtimes (`agentplane-wrapper runtime
// ...`, the scripted runtime) running under a sandbox's directory.
func runtimeProcesses(dir string) []int {
	var out []int
	for _, pid := range sandboxprocs.Under(dir) {
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err == nil && bytes.Contains(cmdline, []byte("\x00runtime\x00")) {
			out = append(out, pid)
		}
	}
	return out
}

// closedAddr is a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	l := testaddr.Listen(t)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}
