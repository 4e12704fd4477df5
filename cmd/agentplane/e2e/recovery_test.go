package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"
	"agentplane.dev/pkg/testenv"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/config"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/pkg/grpcserver"
)

// Issue 18 item 5: a session whose sandbox id equals another session's id
// does not block that session's deletion: each service's fence resources
// carry its own prefix, so the sandbox owner lease and the session's
// deletion lease are different keys.
func TestSandboxIDEqualToASessionIDDoesNotBlockItsDeletion(t *testing.T) {
	s := startSuite(t)
	a := s.create(t, "sbx-victim", "/work/e2e-victim", newSecret())
	var b *sessionv1.Session
	require.Eventually(t, func() bool {
		resp, err := s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: a.GetSessionId(),
			Worktree:   &sessionv1.Worktree{Directory: "/work/e2e-squatter"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
		})
		b = resp.GetSession()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, a.GetSessionId(), b.GetSandboxId())
	s.turn(t, b.GetSessionId(), "m1", "hold the sandbox owner lease") // the sandbox service owns sandbox <a's id> now

	require.Zero(t, s.deleteSession(t, a.GetSessionId()), "a's deletion was never blocked")
	s.deleteSession(t, b.GetSessionId())
}

// Issue 18 item 1 (process level): kill -9 of the sandbox service with
// wrappers up, restart after the wrappers exited (the reconnect window
// passed): the new wrapper's first Hello retires the scope's accepted
// handles (an older owner fence's), so every session of the directory, and
// a new one, completes its next message at once.
func TestRestartPastReconnectWindowRetiresAcceptedHandles(t *testing.T) {
	s, sbx := startProcSuite(t)
	a := s.create(t, "sbx-restart", "/work/e2e-restart", newSecret())
	b := s.create(t, "sbx-restart", "/work/e2e-restart", newSecret())
	s.turn(t, a.GetSessionId(), "m1", "before the crash")
	s.turn(t, b.GetSessionId(), "m1", "before the crash too")
	require.NotEmpty(t, wrapperPIDs(t, a.GetSandboxId()))

	sbx.kill9()
	waitNoWrappers(t, a.GetSandboxId())
	sbx.start()

	s.turn(t, a.GetSessionId(), "m2", "after the restart")
	s.turn(t, b.GetSessionId(), "m2", "after the restart too")
	c := s.create(t, "sbx-restart", "/work/e2e-restart", newSecret())
	s.turn(t, c.GetSessionId(), "m1", "a newcomer")

	for _, id := range []string{a.GetSessionId(), b.GetSessionId(), c.GetSessionId()} {
		s.deleteSession(t, id)
	}
	require.Empty(t, wrapperPIDs(t, a.GetSandboxId()))
}

// Issue 18 item 7 (e2e): deletion tombstones the history of every runtime
// session the session ever had. A re-preparation after a lost route keeps
// the route's runtime session (issue 35: the agent continues the same
// conversation, one history holds it), so that is one here; sessions from
// before that change may hold several, and deletion removes each.
func TestDeletionTombstonesEveryRuntimeSessionsHistory(t *testing.T) {
	s := startSuite(t)
	sess := s.create(t, "sbx-hist", "/work/e2e-hist", newSecret())
	s.turn(t, sess.GetSessionId(), "m1", "the user's first words")
	first := s.routeView(t, sess.GetSessionId()).GetRuntimeSessionId()
	require.NotEmpty(t, first)
	requireHistory(t, s, first)

	// The wrapper dies: the route is lost, the next message re-prepares it.
	pids := wrapperPIDs(t, sess.GetSandboxId())
	require.NotEmpty(t, pids)
	for _, p := range pids {
		pid, err := strconv.Atoi(p)
		require.NoError(t, err)
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	require.Eventually(t, func() bool {
		return s.routeView(t, sess.GetSessionId()).GetState() != sessionv1.RouteState_ROUTE_STATE_READY
	}, 60*time.Second, 50*time.Millisecond, "the route is no longer ready after its wrapper died")
	s.turn(t, sess.GetSessionId(), "m2", "after the wrapper died")
	second := s.routeView(t, sess.GetSessionId()).GetRuntimeSessionId()
	require.Equal(t, first, second, "the re-prepared route keeps its runtime session")
	requireHistory(t, s, second)

	s.deleteSession(t, sess.GetSessionId())
	for _, rs := range []string{first} {
		_, err := s.ing.Export(context.Background(), &ingestv1.ExportRequest{RuntimeSessionId: rs})
		require.Equal(t, codes.NotFound, status.Code(err), "history of %s survived the deletion: %v", rs, err)
	}
}

// requireHistory waits until ingest holds items of the runtime session.
func requireHistory(t *testing.T, s *suite, rs string) {
	t.Helper()
	require.Eventually(t, func() bool {
		resp, err := s.ing.Export(context.Background(), &ingestv1.ExportRequest{RuntimeSessionId: rs})
		return err == nil && len(resp.GetItems()) > 0
	}, 30*time.Second, 50*time.Millisecond, "history of %s", rs)
}

// Issue 18 item 9 (e2e): a failed ReleaseMember is persisted intent,
// retried until it succeeds, and the deletion does not complete before: the
// deleted session never stays a live member of its scope.
func TestMemberReleaseIsRetriedBeforeDeletionCompletes(t *testing.T) {
	s, _, credCut := startProcSuiteCut(t)
	a := s.create(t, "sbx-member", "/work/e2e-member", newSecret())
	b := s.create(t, "sbx-member", "/work/e2e-member", newSecret())
	s.turn(t, a.GetSessionId(), "m1", "a speaks")
	s.turn(t, b.GetSessionId(), "m1", "b speaks")
	rootA := s.routeView(t, a.GetSessionId()).GetRuntimeSessionId()
	sc := &credentialv1.Scope{SandboxId: a.GetSandboxId(), Directory: "/work/e2e-member"}
	live := func() bool {
		resp, err := s.cred.CheckScopeMember(context.Background(), &credentialv1.CheckScopeMemberRequest{Scope: sc, RuntimeSessionId: rootA})
		require.NoError(t, err)
		return resp.GetLive()
	}
	require.True(t, live())

	credCut.setCut(true) // the sandbox cannot reach the credential service
	for range 3 {
		_, err := s.ses.DeleteSession(context.Background(), &sessionv1.DeleteSessionRequest{SessionId: a.GetSessionId()})
		require.Error(t, err, "the deletion completed while the session is still a scope member")
		require.Equal(t, "DELETION_PENDING_CLEANUP", apierr.Reason(err), "%v", err)
		time.Sleep(300 * time.Millisecond)
	}
	require.True(t, live(), "the member is not released yet")

	credCut.setCut(false)
	s.deleteSession(t, a.GetSessionId())
	require.False(t, live(), "the deleted session's root is no longer a live member")
	s.turn(t, b.GetSessionId(), "m2", "b still works")
	s.deleteSession(t, b.GetSessionId())
}

// Issue 18 chaos e2e: three worktrees, five sessions, kill -9 of the sandbox
// service, restart after the reconnect window: every session completes its
// next message; then deleting all leaves no process and no ingest history
// of them.
func TestChaosSandboxKilledPastReconnectWindow(t *testing.T) {
	s, sbx := startProcSuite(t)
	dirs := []string{"/work/chaos-a", "/work/chaos-a", "/work/chaos-b", "/work/chaos-b", "/work/chaos-c"}
	var sessions []*sessionv1.Session
	roots := map[string]bool{}
	for i, dir := range dirs {
		sess := s.create(t, "sbx-chaos", dir, newSecret())
		sessions = append(sessions, sess)
		s.turn(t, sess.GetSessionId(), "m1", "before the crash "+strconv.Itoa(i))
		roots[s.routeView(t, sess.GetSessionId()).GetRuntimeSessionId()] = true
	}
	sandboxID := sessions[0].GetSandboxId()
	require.NotEmpty(t, wrapperPIDs(t, sandboxID))

	sbx.kill9()
	waitNoWrappers(t, sandboxID)
	sbx.start()

	for i, sess := range sessions {
		s.turn(t, sess.GetSessionId(), "m2", "after the restart "+strconv.Itoa(i))
		roots[s.routeView(t, sess.GetSessionId()).GetRuntimeSessionId()] = true
	}
	for rs := range roots {
		requireHistory(t, s, rs)
	}

	for _, sess := range sessions {
		s.deleteSession(t, sess.GetSessionId())
	}
	require.Empty(t, wrapperPIDs(t, sandboxID), "no process of the sessions remains")
	require.Empty(t, sandboxprocs.Under(s.root), "no wrapper or runtime runs under the sandbox root")
	for rs := range roots {
		_, err := s.ing.Export(context.Background(), &ingestv1.ExportRequest{RuntimeSessionId: rs})
		require.Equal(t, codes.NotFound, status.Code(err), "history %s remains: %v", rs, err)
	}
}

// tmpfsRoot mounts a 64 MiB tmpfs with room for only inodes files as a
// sandbox root: its bytes stay far above any capacity threshold while its
// inodes run out. It is unmounted when the test ends (after the services
// stopped and the processes under it were killed).
func tmpfsRoot(t *testing.T, inodes int) string {
	t.Helper()
	root := testenv.SandboxRoot(t)
	out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64m,mode=0755,nr_inodes="+strconv.Itoa(inodes), "tmpfs", root).CombinedOutput()
	if err != nil {
		testenv.Missing(t, "mount a tmpfs sandbox root: %v: %s", err, out)
	}
	t.Cleanup(func() {
		out, err := exec.Command("umount", root).CombinedOutput()
		require.NoError(t, err, "umount %s: %s", root, out)
	})
	return root
}

// fillInodes creates empty files under dir until the filesystem has no
// inode left (ENOSPC), and returns how many it made.
func fillInodes(t *testing.T, dir string) int {
	t.Helper()
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for n := 0; ; n++ {
		f, err := os.Create(filepath.Join(dir, strconv.Itoa(n)))
		if err != nil {
			require.ErrorIs(t, err, syscall.ENOSPC, "the filesystem's inodes run out first")
			return n
		}
		require.NoError(t, f.Close())
	}
}

// Issue 18 item 2 and issue 33 item 6 (process level): inodes exhausted by
// files outside the sandbox tree. A cold workspace whose creation hits the
// real ENOSPC fails its route with sandbox_recovering, and its queued
// messages fail with it instead of waiting for good; a wrapper whose log
// cannot be opened does the same. Recovery touches only the failed route's
// runtime key and only what is recreatable: a user's uncommitted file
// survives (its workspace kept and reported), the sandbox's other wrappers
// keep running, other sandboxes are left alone. The sandbox service then
// restarts on the still-full root: it stays up, not ready, and says why.
// Freeing the inodes lets it start and every session serve again.
func TestENOSPCAfterAdmissionRecovers(t *testing.T) {
	root := tmpfsRoot(t, 512)
	// The root is a 64 MiB tmpfs: admission counts every other live
	// sandbox's unused SANDBOX_DISK_QUOTA as used (decision 55), so the
	// default 4 GiB of sbx-enospc-other would leave 0 bytes and reject
	// sbx-enospc before the inode exhaustion this test is about.
	s, p, _ := startProcSuiteWith(t, procOptions{root: root, env: []string{"SANDBOX_CAPACITY_THRESHOLD", "1MiB", "SANDBOX_DISK_QUOTA", "16MiB"}})
	other := s.create(t, "sbx-enospc-other", "/work/e2e-enospc", newSecret())
	s.turn(t, other.GetSessionId(), "m1", "another sandbox")
	const workDir = "/work/e2e-enospc-work"
	work := s.create(t, "sbx-enospc", workDir, newSecret())
	s.turn(t, work.GetSessionId(), "m1", "write: notes.txt unpushed change")
	warm := s.create(t, "sbx-enospc", "/work/e2e-enospc-warm", newSecret())
	s.turn(t, warm.GetSessionId(), "m1", "a wrapper of the sandbox runs")
	sandboxID := warm.GetSandboxId()
	require.Equal(t, sandboxID, work.GetSandboxId())
	notes := filepath.Join(workspaceOf(t, root, sandboxID, workDir), "notes.txt")
	require.FileExists(t, notes, "the user's uncommitted file")
	warmPIDs := keyPIDs(t, sandboxID, "/work/e2e-enospc-warm")
	require.NotEmpty(t, warmPIDs)

	filler := filepath.Join(root, ".filler") // outside the sandbox tree
	require.Positive(t, fillInodes(t, filler))
	sess := s.create(t, "sbx-enospc", "/work/e2e-enospc-cold", newSecret())
	require.Equal(t, sandboxID, sess.GetSandboxId())
	ctx := context.Background()
	for _, m := range []string{"m1", "m2"} {
		_, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sess.GetSessionId(), MessageId: m, Content: "no room"})
		require.NoError(t, err)
	}
	for _, m := range []string{"m1", "m2"} {
		waitMessageFailed(t, s, sess.GetSessionId(), m)
	}
	rv := s.routeView(t, sess.GetSessionId())
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_FAILED, rv.GetState())
	require.Equal(t, "sandbox_recovering", rv.GetFailureReason())
	// The recovery is over: by this rule its log line, by the old one the
	// sandbox's tree gone.
	require.Eventually(t, func() bool {
		_, err := os.Stat(filepath.Join(root, sandboxID))
		return os.IsNotExist(err) || logHas(p, "runtime key recovered", "/work/e2e-enospc-cold")
	}, 60*time.Second, 50*time.Millisecond, "the cold route's recovery ends")
	require.FileExists(t, notes, "recovery deleted a workspace with an uncommitted file")

	// The case: the user's wrapper is gone, and its relaunch
	// cannot open its log. Its workspace holds the uncommitted file.
	records := func() int {
		m, err := filepath.Glob(filepath.Join(root, sandboxID, "run", "*.json"))
		require.NoError(t, err)
		return len(m)
	}
	before := records()
	for _, pid := range keyPIDs(t, sandboxID, workDir) {
		n, err := strconv.Atoi(pid)
		require.NoError(t, err)
		_ = syscall.Kill(n, syscall.SIGKILL)
	}
	require.Eventually(t, func() bool { return len(keyPIDs(t, sandboxID, workDir)) == 0 && records() < before },
		30*time.Second, 20*time.Millisecond, "the killed wrapper's namespace is gone with its record")
	fillInodes(t, filler+"-2") // take back what its exit freed
	_, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: work.GetSessionId(), MessageId: "m2", Content: "no room for a log"})
	require.NoError(t, err)
	waitMessageFailed(t, s, work.GetSessionId(), "m2")
	waitLog(t, p, "kept the workspace", workDir)

	b, err := os.ReadFile(notes)
	require.NoError(t, err, "recovery deleted a workspace with an uncommitted file")
	require.Equal(t, "unpushed change\n", string(b))
	require.Subset(t, keyPIDs(t, sandboxID, "/work/e2e-enospc-warm"), warmPIDs, "another runtime key's wrapper is not stopped")
	require.DirExists(t, filepath.Join(root, other.GetSandboxId()), "other sandboxes are not touched")

	// The sandbox service restarts while the root is still full: it stays
	// up, not ready, and says why (its old sockets, unlinked at its stop,
	// are taken back first).
	p.stop()
	fillInodes(t, filler+"-3")
	p.start()
	require.Eventually(t, func() bool {
		return !p.alive() || logHas(p, "sandbox root full at start-up", `"replica":"e2e-proc-2"`)
	}, 60*time.Second, 50*time.Millisecond, "the restarted service reports the full root, or exits")
	require.True(t, p.alive(), "a full root at start-up is not an exit")
	conn, err := grpcclient.Dial(procEnv(t, p, "GRPC_ADDR"), token)
	require.NoError(t, err)
	defer conn.Close()
	health := func(svc string) healthpb.HealthCheckResponse_ServingStatus {
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		require.NoError(t, err)
		return resp.GetStatus()
	}
	require.Equal(t, healthpb.HealthCheckResponse_SERVING, health(grpcserver.LivenessService), "alive")
	require.Equal(t, healthpb.HealthCheckResponse_NOT_SERVING, health(""), "not ready while the root is full")

	for _, f := range []string{filler, filler + "-2", filler + "-3"} {
		require.NoError(t, os.RemoveAll(f)) // the inodes come back
	}
	waitLog(t, p, "sandbox root writable again", `"replica":"e2e-proc-2"`)
	require.Eventually(t, func() bool { return health("") == healthpb.HealthCheckResponse_SERVING }, 60*time.Second, 50*time.Millisecond,
		"ready once the root has room")
	s.turn(t, sess.GetSessionId(), "m3", "room again")
	s.turn(t, work.GetSessionId(), "m3", "back after the recovery")
	require.FileExists(t, notes)
	s.turn(t, warm.GetSessionId(), "m2", "never stopped")
	s.turn(t, other.GetSessionId(), "m2", "never touched")
	for _, id := range []*sessionv1.Session{sess, work, warm, other} {
		s.deleteSession(t, id.GetSessionId())
	}
	require.Empty(t, wrapperPIDs(t, sandboxID))
	require.Empty(t, wrapperPIDs(t, other.GetSandboxId()))
}

// waitMessageFailed waits until a queued message failed with its route.
func waitMessageFailed(t *testing.T, s *suite, sessionID, messageID string) {
	t.Helper()
	require.Eventually(t, func() bool {
		got, err := s.ses.GetMessage(context.Background(), &sessionv1.GetMessageRequest{SessionId: sessionID, MessageId: messageID})
		require.NoError(t, err)
		return got.GetMessage().GetState() == sessionv1.MessageState_MESSAGE_STATE_FAILED &&
			got.GetMessage().GetFailureReason() == "route_failed"
	}, 90*time.Second, 100*time.Millisecond, "queued message %s fails with its route instead of staying queued", messageID)
}

// waitLog waits until one line of the process's log holds every part.
func waitLog(t *testing.T, p *proc, parts ...string) {
	t.Helper()
	require.Eventually(t, func() bool { return logHas(p, parts...) }, 60*time.Second, 50*time.Millisecond,
		"a log line of %s with %q", p.name, parts)
}

// logHas reports whether one line of the process's log holds every part.
func logHas(p *proc, parts ...string) bool {
	b, err := os.ReadFile(p.logs)
	if err != nil {
		return false
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		all := true
		for _, part := range parts {
			all = all && strings.Contains(line, part)
		}
		if all {
			return true
		}
	}
	return false
}

// procEnv is a setting of the process (name without the AGENTPLANE_ prefix).
func procEnv(t *testing.T, p *proc, name string) string {
	t.Helper()
	for _, kv := range p.env {
		if v, ok := strings.CutPrefix(kv, config.EnvPrefix+name+"="); ok {
			return v
		}
	}
	t.Fatalf("%s has no %s", p.name, name)
	return ""
}

// keyPIDs lists the live processes of one runtime key of the sandbox.
func keyPIDs(t *testing.T, sandboxID, key string) []string {
	t.Helper()
	var out []string
	for _, pid := range wrapperPIDs(t, sandboxID) {
		env, err := os.ReadFile(filepath.Join("/proc", pid, "environ"))
		if err == nil && slices.Contains(strings.Split(string(env), "\x00"), "AGENTPLANE_RUNTIME_KEY="+key) {
			out = append(out, pid)
		}
	}
	return out
}

// Issue 18 item 15: a runtime key's home goes once its last route is
// released and its wrapper verified absent. Twenty sessions in ten
// directories, each with a turn, all deleted: the sandbox holds no home of
// them (the workspaces stay warm; the stale cleanup takes those).
func TestDeletedSessionsLeaveNoHomes(t *testing.T) {
	s := startSuite(t)
	var sessions []*sessionv1.Session
	for i := range 20 {
		sess := s.create(t, "sbx-homes", "/work/e2e-homes-"+strconv.Itoa(i/2), newSecret())
		s.turn(t, sess.GetSessionId(), "m1", "make a home")
		sessions = append(sessions, sess)
	}
	homes := filepath.Join(s.root, sessions[0].GetSandboxId(), "homes")
	ents, err := os.ReadDir(homes)
	require.NoError(t, err)
	require.Len(t, ents, 10, "one home per runtime key (directory) while they run")
	for _, sess := range sessions {
		s.deleteSession(t, sess.GetSessionId())
	}
	ents, err = os.ReadDir(homes)
	require.NoError(t, err)
	var left []string
	for _, e := range ents {
		left = append(left, e.Name())
	}
	require.Empty(t, left, "homes of deleted sessions stay on disk")
	require.Empty(t, wrapperPIDs(t, sessions[0].GetSandboxId()))
}
