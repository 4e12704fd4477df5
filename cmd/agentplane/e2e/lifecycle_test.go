package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr/apierrtest"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
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
// locators and ingest tombstones, each with a TTL: a scan of the whole
// (private) Redis checks every key against sessionKeyPatterns. The sandbox,
// with no session left, is let go after SANDBOX_EMPTY_GRACE (1 s here)
// with its tree, records and tenant binding.
func TestNothingOutlivesItsSessions(t *testing.T) {
	s := startSuiteWith(t, nil, func(c *sandbox.Config) { c.EmptyGrace = time.Second })
	requireNothingOutlives(t, s, lifecycleRounds{dirs: 5, rounds: 3, perDir: 2, dirPrefix: "/work/e2e-life-",
		fresh: []string{"README.md", "main.go"},
		create: func(t *testing.T, dir, repoURL, token string) *sessionv1.Session {
			return s.createGit(t, "sbx-life", dir, &sessionv1.Worktree{RepoUrl: repoURL}, token)
		},
		work: func(t *testing.T, sess *sessionv1.Session, round, i int) []string {
			file := "r" + strconv.Itoa(round) + "-s" + strconv.Itoa(i) + ".txt"
			return listedFiles(s.turn(t, sess.GetSessionId(), "m1", "write: "+file+" from a session that will be deleted"))
		},
	})
}

// keyFate is what deleting every session may leave of a key pattern.
type keyFate int

const (
	// gone: no key of the pattern is left.
	gone keyFate = iota
	// expires: keys of the pattern stay, each with a TTL.
	expires
	// zeroCounts: a service-wide counter hash naming no session; every
	// count it keeps is 0.
	zeroCounts
)

// sessionKeyPatterns lists every key pattern a session's life writes, in
// every service (grep the key builders: session store key/WipeLocatorKey/
// the idx constants, ingest metaKey/streamKey/latestKey, credential
// credKey/stateKey/versionKey/digestKey, sandbox store.Key/IndexKey/
// leasestore.Key, pkg/fence TokenKey/LeaseKey), and what deletion leaves of
// it: only the wipe locator and the ingest tombstone, each with a TTL (and
// the sandbox's egress byte window, a limit that expires with its window).
var sessionKeyPatterns = []struct {
	re   *regexp.Regexp
	fate keyFate
}{
	// session service
	{regexp.MustCompile(`^ses:\{ses/[^}]+\}:(meta|del|msgs|content|order|active|seen|events|audit|auditn)$`), gone},
	{regexp.MustCompile(`^fence:\{ses/[^}]+\}:(token|lease)$`), gone},
	{regexp.MustCompile(`^ses:wipe:\{ses/[^}]+\}$`), expires},
	{regexp.MustCompile(`^ses:idx:(active|updated|deleting|org:.+|user:.+)$`), gone},
	{regexp.MustCompile(`^ses:idx:states$`), zeroCounts},
	// ingest service
	{regexp.MustCompile(`^ing:\{[^}]+\}:meta$`), expires},
	{regexp.MustCompile(`^ing:\{[^}]+\}:(stream|latest)$`), gone},
	// credential service
	{regexp.MustCompile(`^cred:\{cr:[^}]+\}$`), gone},
	{regexp.MustCompile(`^cred:\{cs:[^}]+\}:(state|version)$`), gone},
	{regexp.MustCompile(`^cred:\{hd:[^}]+\}$`), gone},
	{regexp.MustCompile(`^fence:\{cs:[^}]+\}:(token|lease)$`), gone},
	// sandbox service
	{regexp.MustCompile(`^sbx:\{sbx/[^}]+\}:(meta|routes|scopes|wrappers|slots|tenant|wrapper-leases)$`), gone},
	// The sandbox's egress byte window outlives its owner on purpose, until
	// the window ends (a8d3f7c): deleting it with the sandbox would let a
	// tenant reset its egress allowance by deleting every session. It names
	// no session and expires with the window.
	{regexp.MustCompile(`^sbx:\{sbx/[^}]+\}:egress$`), expires},
	{regexp.MustCompile(`^fence:\{sbx/[^}]+\}:(token|lease)$`), gone},
	{regexp.MustCompile(`^sbx:index$`), gone},
}

// leftKeys scans the suite's private Redis and returns, for every key left,
// why it should not be: it matches no listed pattern (a pattern the list
// misses), its pattern should be gone, it should expire and has no TTL, or
// (for the expiring ones) it is not one of the deleted sessions'.
func leftKeys(t *testing.T, s *suite, sessionIDs, runtimeIDs []string) []string {
	t.Helper()
	ctx := context.Background()
	var bad []string
	iter := s.redis.Scan(ctx, 0, "*", 1000).Iterator()
	for iter.Next(ctx) {
		k := iter.Val()
		fate := -1
		for _, p := range sessionKeyPatterns {
			if p.re.MatchString(k) {
				fate = int(p.fate)
				break
			}
		}
		switch keyFate(fate) {
		case gone:
			bad = append(bad, k+": left behind")
		case expires:
			ttl, err := s.redis.PTTL(ctx, k).Result()
			require.NoError(t, err)
			if ttl <= 0 {
				bad = append(bad, k+": no TTL")
			}
			named := strings.HasPrefix(k, "ses:wipe:") || strings.HasPrefix(k, "ing:")
			if named && !slices.ContainsFunc(append(append([]string(nil), sessionIDs...), runtimeIDs...), func(id string) bool { return strings.Contains(k, "{"+id+"}") || strings.Contains(k, "/"+id+"}") }) {
				bad = append(bad, k+": names none of the deleted sessions")
			}
			if strings.HasPrefix(k, "ing:") && s.redis.HGet(ctx, k, "state").Val() != "deleted" {
				bad = append(bad, k+": not a tombstone")
			}
		case zeroCounts:
			m, err := s.redis.HGetAll(ctx, k).Result()
			require.NoError(t, err)
			for f, v := range m {
				if v != "0" {
					bad = append(bad, k+": "+f+"="+v)
				}
			}
		default:
			bad = append(bad, k+": matches no key pattern a session writes (add it to sessionKeyPatterns)")
		}
	}
	require.NoError(t, iter.Err())
	slices.Sort(bad)
	return bad
}

// requireOnlyExpiringKeys checks every key pattern a session writes after
// the sessions were deleted (leftKeys), waiting for the sandbox with no
// session left to be let go (SANDBOX_EMPTY_GRACE). Each wipe locator and
// each runtime session's tombstone is there.
func requireOnlyExpiringKeys(t *testing.T, s *suite, sessionIDs, runtimeIDs []string) {
	t.Helper()
	ctx := context.Background()
	for _, id := range sessionIDs {
		require.Equal(t, int64(1), s.redis.Exists(ctx, "ses:wipe:{ses/"+id+"}").Val(), "wipe locator of %s", id)
	}
	for _, rs := range runtimeIDs {
		require.NotEmpty(t, rs)
		require.Equal(t, "deleted", s.redis.HGet(ctx, "ing:{"+rs+"}:meta", "state").Val(), "tombstone of %s", rs)
	}
	var bad []string
	deadline := time.Now().Add(30 * time.Second)
	for {
		if bad = leftKeys(t, s, sessionIDs, runtimeIDs); len(bad) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	require.Empty(t, bad, "only wipe locators and tombstones, each with a TTL, are left")
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
	apierrtest.RequireStatus(t, create("org/other.git"), codes.FailedPrecondition, "WORKTREE_REPO_MISMATCH")
	require.NoError(t, create("org/app.git"), "the directory's own repository is admitted")

	s.deleteSession(t, first.GetSessionId())
	next := s.createGit(t, "sbx-bound", dir+"-2", &sessionv1.Worktree{RepoUrl: g.RepoURL("org/other.git")}, token)
	events := s.turn(t, next.GetSessionId(), "m1", "what is here")
	require.ElementsMatch(t, []string{"OTHER.md"}, listedFiles(events))
}

// TestHistoryExportSpansAnIdleStop (issue 32 item 6): after an idle stop
// (the sandbox service's SANDBOX_IDLE_STOP) the next message re-prepares
// the route under the same runtime session (issue 35); one ExportHistory by
// session id returns every turn, in order, paged.
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
	require.Equal(t, first, second, "the resumed route keeps its runtime session")

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
	require.Equal(t, []string{first}, order, "one runtime session holds the history")

	s.deleteSession(t, id)
	_, err := s.ses.ExportHistory(context.Background(), &sessionv1.ExportHistoryRequest{SessionId: id})
	apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
}

// freeBytes is what statfs says an unprivileged writer may still use on
// dir's filesystem.
func freeBytes(t *testing.T, dir string) uint64 {
	t.Helper()
	var st syscall.Statfs_t
	require.NoError(t, syscall.Statfs(dir, &st))
	return st.Bavail * uint64(st.Bsize)
}

// TestDeletingTheDiskFillerFreesItsSpace (issue 32 item 5: a session that
// filled the shared root was deleted with its 255 MiB file left in place,
// and other tenants stayed capacity_rejected until someone removed it by
// hand). On a 64 MiB tmpfs sandbox root with a 32 MiB admission threshold,
// tenant A's session writes 40 MiB (over its 16 MiB quota: its runtime is
// stopped); tenant B's new worktree is then refused capacity_rejected.
// DeleteSession(A) frees the space by the time it answers (statfs right
// after, no waiting), and B's next message is admitted and its turn runs.
func TestDeletingTheDiskFillerFreesItsSpace(t *testing.T) {
	root := tmpfsRoot(t, 1<<16)
	const threshold = 32 << 20
	s := startSuiteTuned(t, stackOptions{root: root}, func(c *sandbox.Config) {
		c.DiskQuota = 16 << 20
		c.CapacityThreshold = threshold
	}, nil)
	a := s.create(t, "sbx-fill-a", "/work/e2e-fill", newSecret())
	s.turn(t, a.GetSessionId(), "m1", "hello")
	// The writing turn ends succeeded, or failed disk_quota when the quota's
	// sample stops the runtime first (as in requireDiskQuotaHolds).
	_, err := s.ses.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: a.GetSessionId(), MessageId: "m2",
		Content: "run: dd if=/dev/zero of=filler bs=1M count=40"})
	require.NoError(t, err)
	require.Contains(t, []string{"", "disk_quota"}, s.messageFailure(t, a.GetSessionId(), "m2"))
	require.Eventually(t, func() bool {
		return s.routeView(t, a.GetSessionId()).GetState() != sessionv1.RouteState_ROUTE_STATE_READY
	}, 90*time.Second, 100*time.Millisecond, "A's runtime is stopped for its quota")
	fillers, err := filepath.Glob(filepath.Join(root, a.GetSandboxId(), "workspaces", "*", "filler"))
	require.NoError(t, err)
	require.Len(t, fillers, 1, "A's filler is on the sandbox root")
	require.Less(t, freeBytes(t, root), uint64(threshold), "the filler holds the space admission needs")

	var b *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-other", OrgId: "o-other", SandboxId: "sbx-fill-b-" + s.run,
			Worktree:   &sessionv1.Worktree{Directory: "/work/e2e-fill"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
		})
		b = resp.GetSession()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	route, _ := s.failedRoute(t, b.GetSessionId())
	require.Equal(t, "capacity_rejected", route, "the other tenant's worktree is refused while the filler's file is there")

	s.deleteSession(t, a.GetSessionId())
	require.NoFileExists(t, fillers[0], "the filler's file went with its session")
	require.GreaterOrEqual(t, freeBytes(t, root), uint64(threshold), "the space is free when DeleteSession answers")

	s.turn(t, b.GetSessionId(), "m2", "hello from the other tenant")
}

// TestNothingOutlivesItsOpencodeSessions is TestNothingOutlivesItsSessions
// with the pinned opencode agent (on the fake model) instead of the
// scripted runtime: 3 directories of a real repository on git
// http-backend, 2 sessions at a time per directory sharing one opencode
// process, 2 rounds (12 sessions in `make test`; the acceptance's 30 over 5
// directories, AGENTPLANE_LIFECYCLE_FULL=1, took 246 s beside two CI runs
// on 2 cores, mostly opencode starting: too much to add to every run of the
// e2e package); each directory's first session asks the
// agent to create hello.txt, the second pushes (a commit moves HEAD). After
// each round every session is deleted: no workspace, home or log is left;
// the next round's checkout is a fresh clone (HEAD at the remote's ref,
// only the repository's files and this turn's hello.txt); at the end the
// sandbox's tree is gone and only expiring wipe locators and tombstones are
// left in Redis (sessionKeyPatterns).
func TestNothingOutlivesItsOpencodeSessions(t *testing.T) {
	s := startACPSuite(t, "opencode", func(c *sandbox.Config) { c.EmptyGrace = time.Second })
	dirs, rounds := 3, 2
	if os.Getenv("AGENTPLANE_LIFECYCLE_FULL") != "" {
		dirs, rounds = 5, 3
	}
	requireNothingOutlives(t, s.suite, lifecycleRounds{dirs: dirs, rounds: rounds, perDir: 2, dirPrefix: "/work/e2e-oc-",
		fresh: []string{".git", "README.md", "main.go", "hello.txt"},
		create: func(t *testing.T, dir, repoURL, token string) *sessionv1.Session {
			var sess *sessionv1.Session
			require.Eventually(t, func() bool {
				resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
					UserId: "u-e2e", OrgId: "o-e2e", SandboxId: "sbx-oc-" + s.run,
					Worktree:      &sessionv1.Worktree{Directory: dir, RepoUrl: repoURL},
					Credential:    &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
					GitCredential: &sessionv1.GitCredentialInput{Token: token},
					Agent:         &sessionv1.Agent{Profile: "opencode"},
				})
				sess = resp.GetSession()
				return err == nil
			}, 60*time.Second, 100*time.Millisecond)
			return sess
		},
		work: func(t *testing.T, sess *sessionv1.Session, _, _ int) []string {
			_, o := s.watchTurn(t, sess.GetSessionId(), "m1", "Please create hello.txt", nil)
			require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
			ents, err := os.ReadDir(workspaceOf(t, s.root, sess.GetSandboxId(), sess.GetWorktree().GetDirectory()))
			require.NoError(t, err)
			var names []string
			for _, e := range ents {
				names = append(names, e.Name())
			}
			return names
		},
	})
}

// lifecycleRounds is one runtime's shape of requireNothingOutlives.
type lifecycleRounds struct {
	dirs, rounds, perDir int
	dirPrefix            string
	// fresh is what the checkout holds after a directory's first session of a
	// round did its work: the repository's files and that work only.
	fresh  []string
	create func(t *testing.T, dir, repoURL, token string) *sessionv1.Session
	// work runs session i's turn of a round and returns the files it saw in
	// its checkout.
	work func(t *testing.T, sess *sessionv1.Session, round, i int) []string
}

// requireNothingOutlives creates and deletes rounds × dirs × perDir sessions
// on a real repository (git http-backend), each directory's second session
// pushing a commit (HEAD moves), and checks: after each round no workspace,
// home or log is left; each round's first session of a directory finds a
// fresh clone (HEAD at the remote's ref, only l.fresh); at the end no
// wrapper, the sandbox let go with its tree, and only expiring wipe locators
// and tombstones in Redis (requireOnlyExpiringKeys).
func requireNothingOutlives(t *testing.T, s *suite, l lifecycleRounds) {
	require.NotNil(t, s.redis)
	token := "ghs_e2e" + newSecret()
	g := gittest.Start(t, token)
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n", "main.go": "package main\n"})
	remoteHead := strings.TrimSpace(gittest.Run(t, "", "ls-remote", g.AuthURL("org/app.git"), "refs/heads/main"))
	remoteHead, _, _ = strings.Cut(remoteHead, "\t")
	require.Len(t, remoteHead, 40)

	var sandboxID string
	var sessionIDs, runtimeIDs []string
	for round := range l.rounds {
		var live []*sessionv1.Session
		for d := range l.dirs {
			dir := l.dirPrefix + strconv.Itoa(d)
			for i := range l.perDir {
				sess := l.create(t, dir, g.RepoURL("org/app.git"), token)
				sandboxID = sess.GetSandboxId()
				files := l.work(t, sess, round, i)
				if i == 0 {
					require.ElementsMatch(t, l.fresh, files, "round %d dir %d: a fresh clone", round, d)
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
	require.Len(t, sessionIDs, l.dirs*l.rounds*l.perDir)
	require.Empty(t, wrapperPIDs(t, sandboxID))
	requireOnlyExpiringKeys(t, s, sessionIDs, runtimeIDs)
	require.NoDirExists(t, filepath.Join(s.root, sandboxID), "the sandbox with no session left was let go with its tree")
}
