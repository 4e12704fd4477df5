package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/gittest"
	sandbox "agentplane.dev/services/sandbox/server"
)

// createRepo makes a session on wt's repository without a git credential.
func (s *suite) createRepo(t testing.TB, sandboxID, dir string, wt *sessionv1.Worktree) *sessionv1.Session {
	wt.Directory = dir
	var out *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: sandboxID + "-" + s.run, Worktree: wt,
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
		})
		out = resp.GetSession()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	return out
}

// workspaceOf finds the sandbox's workspace of dir (named after its last
// element and a hash of the whole path).
func workspaceOf(t *testing.T, root, sandboxID, dir string) string {
	m, err := filepath.Glob(filepath.Join(root, sandboxID, "workspaces", filepath.Base(dir)+"-*"))
	require.NoError(t, err)
	require.Len(t, m, 1, "one workspace of %s", dir)
	return m[0]
}

// headOf reads HEAD of the checkout of dir in the sandbox.
func headOf(t *testing.T, root, sandboxID, dir string) string {
	ws := workspaceOf(t, root, sandboxID, dir)
	out, err := exec.Command("git", "-c", "safe.directory=*", "-C", ws, "rev-parse", "HEAD").CombinedOutput()
	require.NoError(t, err, "%s", out)
	return strings.TrimSpace(string(out))
}

// sandboxLeftovers lists what is left under the sandbox's tree: entries of
// workspaces/ and homes/, and wrapper logs.
func sandboxLeftovers(t *testing.T, root, sandboxID string) []string {
	var left []string
	for _, sub := range []string{"workspaces", "homes"} {
		ents, err := os.ReadDir(filepath.Join(root, sandboxID, sub))
		if os.IsNotExist(err) {
			continue
		}
		require.NoError(t, err)
		for _, e := range ents {
			left = append(left, sub+"/"+e.Name())
		}
	}
	logs, err := filepath.Glob(filepath.Join(root, sandboxID, "logs", "*.log"))
	require.NoError(t, err)
	for _, l := range logs {
		left = append(left, "logs/"+filepath.Base(l))
	}
	return left
}

// TestNothingOutlivesItsSessions (issue 32): thirty sessions over five
// directories of a real repository on git http-backend, two at a time per
// directory, each writing a file and one of them committing; after each
// round every session is deleted. Then: no workspace, home or wrapper log
// of them is left under the sandbox root, the next round's session of a
// directory gets a fresh clone (none of the deleted sessions' files, HEAD
// at the remote's ref), and no Redis key of theirs is left but wipe
// locators and ingest tombstones, each with a TTL.
func TestNothingOutlivesItsSessions(t *testing.T) {
	s := startSuite(t)
	require.NotNil(t, s.redis)
	token := "ghs_e2e" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n", "main.go": "package main\n"})
	remoteHead := strings.TrimSpace(gittest.Run(t, "", "ls-remote", g.AuthURL("org/app.git"), "refs/heads/main"))
	remoteHead, _, _ = strings.Cut(remoteHead, "\t")
	require.Len(t, remoteHead, 40)

	const dirs, rounds, perDir = 5, 3, 2
	var sandboxID string
	var sessionIDs, runtimeIDs []string
	for round := range rounds {
		var live []*sessionv1.Session
		for d := range dirs {
			dir := "/work/e2e-life-" + strconv.Itoa(d)
			for i := range perDir {
				sess := s.createGit(t, "sbx-life", dir, &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git")}, token)
				sandboxID = sess.GetSandboxId()
				file := "r" + strconv.Itoa(round) + "-s" + strconv.Itoa(i) + ".txt"
				events := s.turn(t, sess.GetSessionId(), "m1", "write: "+file+" from a session that will be deleted")
				if i == 0 {
					// The directory's first session of the round finds a fresh
					// clone: nothing of an earlier round's sessions.
					require.ElementsMatch(t, []string{"README.md", "main.go"}, listedFiles(events), "round %d dir %d", round, d)
					require.Equal(t, remoteHead, headOf(t, s.root, sandboxID, dir), "HEAD at the remote's ref")
				}
				if i == 1 {
					// A commit the remote does not have moves the checkout's HEAD.
					_, err := s.ses.PushWorktree(context.Background(), &sessionv1.PushWorktreeRequest{
						SessionId: sess.GetSessionId(), Branch: "agent/" + sess.GetSessionId(), CommitMessage: "work"})
					require.NoError(t, err)
					require.NotEqual(t, remoteHead, headOf(t, s.root, sandboxID, dir))
				}
				sessionIDs = append(sessionIDs, sess.GetSessionId())
				runtimeIDs = append(runtimeIDs, s.routeView(t, sess.GetSessionId()).GetRuntimeSessionId())
				live = append(live, sess)
			}
		}
		for _, sess := range live {
			s.deleteSession(t, sess.GetSessionId())
		}
		require.Empty(t, sandboxLeftovers(t, s.root, sandboxID), "round %d: the deleted sessions' data is gone", round)
	}
	require.Len(t, sessionIDs, dirs*rounds*perDir)
	require.Empty(t, wrapperPIDs(t, sandboxID))
	requireOnlyExpiringKeys(t, s, sandboxID, sessionIDs, runtimeIDs)
}

// requireOnlyExpiringKeys checks every key pattern a session writes, in
// every service, after the sessions were deleted: the session's own keys
// (ses:{ses/<id>}:*), its fence keys, its wipe locator (kept, with a TTL),
// its runtime sessions' ingest keys (only the tombstone, with a TTL), and
// the sandbox's records of it.
func requireOnlyExpiringKeys(t *testing.T, s *suite, sandboxID string, sessionIDs, runtimeIDs []string) {
	t.Helper()
	ctx := context.Background()
	rdb := s.redis
	count := func(pattern string) []string {
		keys, err := rdb.Keys(ctx, pattern).Result()
		require.NoError(t, err)
		return keys
	}
	requireTTL := func(key string) {
		ttl, err := rdb.PTTL(ctx, key).Result()
		require.NoError(t, err)
		require.Positive(t, ttl, "%s expires", key)
	}
	for _, id := range sessionIDs {
		require.Empty(t, count("ses:{ses/"+id+"}:*"), "session keys of %s", id)
		require.Empty(t, count("fence:{ses/"+id+"}:*"), "fence keys of %s", id)
		require.Equal(t, []string{"ses:wipe:{ses/" + id + "}"}, count("*"+id+"*"), "only the wipe locator names %s", id)
		requireTTL("ses:wipe:{ses/" + id + "}")
	}
	for _, rs := range runtimeIDs {
		require.NotEmpty(t, rs)
		require.Equal(t, []string{"ing:{" + rs + "}:meta"}, count("*"+rs+"*"), "only the tombstone of %s", rs)
		require.Equal(t, "deleted", rdb.HGet(ctx, "ing:{"+rs+"}:meta", "state").Val())
		requireTTL("ing:{" + rs + "}:meta")
	}
	// The sandbox has no session left: none of its records (routes, scopes,
	// wrappers, slots, wrapper leases) stays.
	for _, kind := range []string{"routes", "scopes", "wrappers", "slots", "wrapper-leases"} {
		require.Empty(t, count("sbx:{sbx/"+sandboxID+"}:"+kind), "sandbox %s records", kind)
	}
	// Nothing else in any service names a session: the credential service's
	// grants, members and scopes of them.
	all := count("*")
	for _, k := range all {
		for _, id := range sessionIDs {
			if strings.Contains(k, id) {
				require.Equal(t, "ses:wipe:{ses/"+id+"}", k)
			}
		}
	}
	t.Logf("keys left after deleting every session: %v", all)
}

// TestRepositoryIsAlwaysCloned (issue 32 item 4, replaces decision 41): a
// session that names a public repository and no git credential gets it
// cloned anonymously through the git route; one that names a private
// repository without a credential fails its route with repo_auth_failed,
// and an event says so. The agent never runs in an empty workspace.
func TestRepositoryIsAlwaysCloned(t *testing.T) {
	s := startSuite(t)
	token := "ghs_e2e" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/pub.git", map[string]string{"README.md": "public\n", "lib.go": "package lib\n"})
	g.CreateRepo(t, "org/priv.git", map[string]string{"SECRET.md": "private\n"})
	g.MakePublic("org/pub.git")

	pub := s.createRepo(t, "sbx-anon", "/work/e2e-pub", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/pub.git")})
	events := s.turn(t, pub.GetSessionId(), "m1", "what is here")
	require.ElementsMatch(t, []string{"README.md", "lib.go"}, listedFiles(events), "the public repository was cloned")
	require.Positive(t, cloneRequests(g))
	for _, r := range g.Log() {
		require.False(t, r.CarriedToken, "no token on an anonymous clone: %+v", r)
	}

	priv := s.createRepo(t, "sbx-anon", "/work/e2e-priv", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/priv.git")})
	route, message := s.failedRoute(t, priv.GetSessionId())
	require.Equal(t, "repo_auth_failed", route)
	require.Equal(t, "route_failed", message)
	var said bool
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: priv.GetSessionId()})
	require.NoError(t, err)
	for !said {
		resp, err := stream.Recv()
		require.NoError(t, err)
		if r := resp.GetEvent().GetRoute(); r != nil && r.GetState() == sessionv1.RouteState_ROUTE_STATE_FAILED {
			said = r.GetFailureReason() == "repo_auth_failed"
		}
	}
	m, _ := filepath.Glob(filepath.Join(s.root, priv.GetSandboxId(), "workspaces", "e2e-priv-*", "*"))
	require.Empty(t, m, "nothing of a failed clone is left to be reused")
}

// TestDirectoryIsBoundToItsRepository (issue 32 item 3): while a session of
// a directory lives, CreateSession naming the directory with another
// repo_url is refused with FAILED_PRECONDITION WORKTREE_REPO_MISMATCH; the
// same repository is admitted; once every session of the directory is
// deleted the directory may take another repository.
func TestDirectoryIsBoundToItsRepository(t *testing.T) {
	s := startSuite(t)
	token := "ghs_e2e" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "app\n"})
	g.CreateRepo(t, "org/other.git", map[string]string{"OTHER.md": "other\n"})
	dir := "/work/e2e-bound"
	first := s.createGit(t, "sbx-bound", dir, &sessionv1.Worktree{RepoUrl: g.RepoURL("org/app.git")}, token)
	s.turn(t, first.GetSessionId(), "m1", "what is here")

	create := func(repo string) error {
		_, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: first.GetSandboxId(),
			Worktree:      &sessionv1.Worktree{Directory: dir, RepoUrl: g.RepoURL(repo)},
			Credential:    &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
			GitCredential: &sessionv1.GitCredentialInput{Token: token},
		})
		return err
	}
	requireReason(t, create("org/other.git"), codes.FailedPrecondition, "WORKTREE_REPO_MISMATCH")
	require.NoError(t, create("org/app.git"), "the directory's own repository is admitted")

	s.deleteSession(t, first.GetSessionId())
	next := s.createGit(t, "sbx-bound", dir+"-2", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/other.git")}, token)
	events := s.turn(t, next.GetSessionId(), "m1", "what is here")
	require.ElementsMatch(t, []string{"OTHER.md"}, listedFiles(events))
}

// TestHistoryExportSpansAnIdleStop (issue 32 item 6): after an idle stop
// (the sandbox service's SANDBOX_IDLE_STOP) the next message re-prepares
// the route under a new runtime session; one ExportHistory by session id
// returns every turn, in order, paged.
func TestHistoryExportSpansAnIdleStop(t *testing.T) {
	s := startSuiteWith(t, nil, func(c *sandbox.Config) { c.Timers.IdleStop = 2 * time.Second })
	sess := s.create(t, "sbx-hist1", "/work/e2e-hist1", newSecret())
	id := sess.GetSessionId()
	s.turn(t, id, "m1", "the first turn")
	first := s.routeView(t, id).GetRuntimeSessionId()
	require.Eventually(t, func() bool { return s.routeView(t, id).GetState() != sessionv1.RouteState_ROUTE_STATE_READY },
		2*time.Minute, 100*time.Millisecond, "the idle runtime is stopped")
	s.turn(t, id, "m2", "the second turn")
	second := s.routeView(t, id).GetRuntimeSessionId()
	require.NotEqual(t, first, second, "the resumed route has a new runtime session")

	var items []*sessionv1.HistoryItem
	require.Eventually(t, func() bool {
		items = nil
		token := ""
		for {
			resp, err := s.ses.ExportHistory(context.Background(), &sessionv1.ExportHistoryRequest{SessionId: id, PageSize: 3, PageToken: token})
			require.NoError(t, err)
			items = append(items, resp.GetItems()...)
			if token = resp.GetNextPageToken(); token == "" {
				break
			}
		}
		var all strings.Builder
		for _, it := range items {
			all.Write(it.GetItem().GetPayload())
		}
		a, b := strings.Index(all.String(), "the first turn"), strings.Index(all.String(), "the second turn")
		return a >= 0 && b > a
	}, time.Minute, 200*time.Millisecond, "both turns, in order, in one export")
	var order []string
	for _, it := range items {
		if len(order) == 0 || order[len(order)-1] != it.GetRuntimeSessionId() {
			order = append(order, it.GetRuntimeSessionId())
		}
	}
	require.Equal(t, []string{first, second}, order, "runtime sessions in the order the route had them")

	s.deleteSession(t, id)
	_, err := s.ses.ExportHistory(context.Background(), &sessionv1.ExportHistoryRequest{SessionId: id})
	requireReason(t, err, codes.NotFound, "SESSION_NOT_FOUND")
}
