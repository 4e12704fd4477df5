package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"
	"agentplane.dev/pkg/testenv"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
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

// Issue 18 item 7 (e2e): a re-preparation after a lost route gives the route
// a new runtime session id; deletion tombstones the history of every runtime
// session the session ever had, not only the latest.
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
	require.NotEqual(t, first, second, "the re-prepared route has a new runtime session")
	requireHistory(t, s, second)

	s.deleteSession(t, sess.GetSessionId())
	for _, rs := range []string{first, second} {
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
	root := sandboxRoot(t)
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

// Issue 18 item 2 (process level): a cold workspace whose creation hits a
// real ENOSPC (inodes exhausted on a filesystem far above the byte
// threshold) fails the route with sandbox_recovering, and the queued
// messages fail with it instead of waiting for good; recovery stops the
// sandbox's other wrapper and deletes the sandbox's tree only once no
// wrapper of it runs, and leaves other sandboxes alone; freeing the inodes
// lets the next messages complete.
func TestENOSPCAfterAdmissionRecovers(t *testing.T) {
	root := tmpfsRoot(t, 512)
	// The root is a 64 MiB tmpfs: admission counts every other live
	// sandbox's unused SANDBOX_DISK_QUOTA as used (decision 55), so the
	// default 4 GiB of sbx-enospc-other would leave 0 bytes and reject
	// sbx-enospc before the inode exhaustion this test is about.
	s, _, _ := startProcSuiteWith(t, procOptions{root: root, env: []string{"SANDBOX_CAPACITY_THRESHOLD", "1MiB", "SANDBOX_DISK_QUOTA", "16MiB"}})
	other := s.create(t, "sbx-enospc-other", "/work/e2e-enospc", newSecret())
	s.turn(t, other.GetSessionId(), "m1", "another sandbox")
	warm := s.create(t, "sbx-enospc", "/work/e2e-enospc-warm", newSecret())
	s.turn(t, warm.GetSessionId(), "m1", "a wrapper of the sandbox runs")
	sandboxID := warm.GetSandboxId()
	sbDir := filepath.Join(root, sandboxID)

	// Watch for the lie recovery must never tell: the sandbox's tree gone
	// while a wrapper of it still runs.
	var mu sync.Mutex
	var early []string
	stop := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			pids, lerr := listWrapperPIDs(sandboxID)
			if _, err := os.Stat(sbDir); lerr == nil && os.IsNotExist(err) && len(pids) > 0 {
				mu.Lock()
				early = append(early, pids...)
				mu.Unlock()
			}
		}
	}()

	filler := filepath.Join(root, ".filler")
	require.Positive(t, fillInodes(t, filler)) // a new workspace needs inodes the filesystem no longer has
	sess := s.create(t, "sbx-enospc", "/work/e2e-enospc-cold", newSecret())
	require.Equal(t, sandboxID, sess.GetSandboxId())
	ctx := context.Background()
	for _, m := range []string{"m1", "m2"} {
		_, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sess.GetSessionId(), MessageId: m, Content: "no room"})
		require.NoError(t, err)
	}
	for _, m := range []string{"m1", "m2"} {
		require.Eventually(t, func() bool {
			got, err := s.ses.GetMessage(ctx, &sessionv1.GetMessageRequest{SessionId: sess.GetSessionId(), MessageId: m})
			require.NoError(t, err)
			return got.GetMessage().GetState() == sessionv1.MessageState_MESSAGE_STATE_FAILED &&
				got.GetMessage().GetFailureReason() == "route_failed"
		}, 60*time.Second, 100*time.Millisecond, "queued message %s fails with its route instead of staying queued", m)
	}
	rv := s.routeView(t, sess.GetSessionId())
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_FAILED, rv.GetState())
	require.Equal(t, "sandbox_recovering", rv.GetFailureReason())
	require.Eventually(t, func() bool {
		_, err := os.Stat(sbDir)
		return os.IsNotExist(err) && len(wrapperPIDs(t, sandboxID)) == 0
	}, 60*time.Second, 20*time.Millisecond, "recovery stops the sandbox's wrappers and deletes its tree")
	close(stop)
	<-watched
	require.Empty(t, early, "the sandbox's tree was deleted while its wrappers ran")
	require.DirExists(t, filepath.Join(root, other.GetSandboxId()), "recovery destroys that sandbox only")

	require.NoError(t, os.RemoveAll(filler)) // the inodes come back
	s.turn(t, sess.GetSessionId(), "m3", "room again")
	s.turn(t, warm.GetSessionId(), "m2", "back after the recovery")
	s.turn(t, other.GetSessionId(), "m2", "never touched")
	for _, id := range []*sessionv1.Session{sess, warm, other} {
		s.deleteSession(t, id.GetSessionId())
	}
	require.Empty(t, wrapperPIDs(t, sandboxID))
	require.Empty(t, wrapperPIDs(t, other.GetSandboxId()))
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
