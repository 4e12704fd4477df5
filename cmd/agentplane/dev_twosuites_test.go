package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/logging/logtest"
)

// devSuite is one running `agentplane dev` with its own sandbox root,
// ports and private Redis.
type devSuite struct {
	root     string
	sessions sessionv1.SessionServiceClient
	logs     *logtest.Buffer
	stop     func() error // SIGTERM, then wait for the exit
}

func startDevSuite(t *testing.T, bin string) *devSuite {
	t.Helper()
	root := t.TempDir()
	base := freePortBase(t)
	cmd := exec.Command(bin, "dev", "--sandbox-root", root, "--port-base", strconv.Itoa(base), "--pool", "off",
		"--metrics-port-base", "0", "--drain-delay", "100ms")
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	logs := &logtest.Buffer{}
	cmd.Stderr = io.MultiWriter(t.Output(), logs)
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			t.Log(sc.Text())
		}
	}()
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-exited:
			return err
		case <-time.After(60 * time.Second):
			_ = cmd.Process.Kill()
			return errors.New("agentplane dev did not exit after SIGTERM")
		}
	}
	t.Cleanup(func() { _ = stop(); sandboxprocs.Stop(root, time.Second, 10*time.Second) })

	addr := fmt.Sprintf("127.0.0.1:%d", base)
	conn := devConn(t, addr, addr)
	t.Cleanup(func() { _ = conn.Close() })
	waitServing(t, conn, addr)
	return &devSuite{root: root, sessions: sessionv1.NewSessionServiceClient(conn), logs: logs, stop: stop}
}

// runTurn creates a session of org o1 and user u1 (the same sandbox id in
// every suite) and runs one turn in it.
func (s *devSuite) runTurn(t *testing.T) string {
	t.Helper()
	created, err := s.sessions.CreateSession(t.Context(), &sessionv1.CreateSessionRequest{
		UserId: "u1", OrgId: "o1", Worktree: &sessionv1.Worktree{Directory: "/work/two-suites"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-two-suites"},
	})
	require.NoError(t, err)
	id := created.GetSession().GetSessionId()
	s.runTurnIn(t, id, "m1")
	return id
}

// deleteSession retries DeleteSession until the cleanup is verified.
func (s *devSuite) deleteSession(t *testing.T, id string) {
	t.Helper()
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := s.sessions.DeleteSession(ctx, &sessionv1.DeleteSessionRequest{SessionId: id})
		require.True(t, err == nil || status.Code(err) == codes.FailedPrecondition, "DeleteSession: %v", err)
		return err == nil
	}, 60*time.Second, 200*time.Millisecond, "DeleteSession never verified its cleanup")
}

// alive reports whether every pid is still a live process (not a zombie).
func alive(pids []int) bool {
	for _, pid := range pids {
		stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
		if err != nil || strings.Contains(string(stat), ") Z ") {
			return false
		}
	}
	return true
}

// TestTwoDevSuitesOnOneHost runs two `agentplane dev` suites side by side:
// different sandbox roots and ports, the same org and user (so the same
// sandbox id) and each its own Redis, so neither knows of the other's
// wrappers. B starts after A's wrapper runs: B's adoption of the sandbox
// sweeps it for leaks, and that sweep must not see A's wrapper. Then
// deleting A's session, and stopping A, leave B's wrapper running.
func TestTwoDevSuitesOnOneHost(t *testing.T) {
	bin := buildAgentplane(t)

	a := startDevSuite(t, bin)
	sessA := a.runTurn(t)
	wrappersA := sandboxprocs.Under(a.root)
	require.NotEmpty(t, wrappersA, "A's wrapper runs under A's root")

	b := startDevSuite(t, bin)
	sessB := b.runTurn(t)
	wrappersB := sandboxprocs.Under(b.root)
	require.NotEmpty(t, wrappersB, "B's wrapper runs under B's root")

	// Both sandboxes were adopted (and swept) by now; a second turn in
	// each goes to the same wrapper, which is still the one it was.
	a.runTurnIn(t, sessA, "m2")
	b.runTurnIn(t, sessB, "m2")
	require.True(t, alive(wrappersA), "A's wrapper survived B's sweep")
	require.True(t, alive(wrappersB), "B's wrapper survived A's")
	for _, s := range []*devSuite{a, b} {
		require.NotContains(t, s.logs.String(), "leaked wrapper found", "a suite took the other's wrapper for a leak")
	}

	// Deleting A's session stops A's wrapper only.
	a.deleteSession(t, sessA)
	require.Eventually(t, func() bool { return len(sandboxprocs.Under(a.root)) == 0 }, 30*time.Second, 100*time.Millisecond,
		"A's wrapper is gone after A's deletion")
	require.True(t, alive(wrappersB), "A's deletion left B's wrapper running")

	// Stopping A (dev stops everything under its root on the way out)
	// leaves B's wrapper running, and B still serves turns.
	require.NoError(t, a.stop(), "A exits 0")
	require.True(t, alive(wrappersB), "A's shutdown left B's wrapper running")
	b.runTurnIn(t, sessB, "m3")
	require.True(t, alive(wrappersB), "B's turns still go to its first wrapper")
}

// runTurnIn sends one more message to a session and waits for its outcome.
func (s *devSuite) runTurnIn(t *testing.T, id, messageID string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	watch, err := s.sessions.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: id})
	require.NoError(t, err)
	_, err = s.sessions.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, MessageId: messageID, Content: "again"})
	require.NoError(t, err)
	for {
		resp, err := watch.Recv()
		require.NoError(t, err)
		if o := resp.GetEvent().GetOutcome(); o != nil && o.GetLastMessageId() == messageID {
			require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
			return
		}
	}
}
