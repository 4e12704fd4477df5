package e2e

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	sandbox "agentplane.dev/services/sandbox/server"
)

// BenchmarkOpenSessions (DESIGN.md 3.8): many open sessions on one node,
// few active. Sessions come in waves of `active` at a time: each wave's
// sessions are created and answer a turn together, then are suspended,
// except the last wave's, which stay active. The scripted runtime serves
// all but the last wave, opencode (fake model) the last. Then: the node's
// sandbox processes are only the active sandboxes' (a suspended one runs
// none), their memory is summed (PSS), one suspended session resumes and
// answers, and after every session is deleted no sandbox process, workspace
// or home is left. b.N is not used: one run is the measurement.
//
//	cd cmd/agentplane && go test ./e2e -run '^$' -bench '^BenchmarkOpenSessions$' -benchtime 1x -timeout 30m
//
// AGENTPLANE_OPEN_SESSIONS (default 200) and AGENTPLANE_ACTIVE_SESSIONS
// (default 10) change the shape.
func BenchmarkOpenSessions(b *testing.B) {
	total, active := envCount(b, "AGENTPLANE_OPEN_SESSIONS", 200), envCount(b, "AGENTPLANE_ACTIVE_SESSIONS", 10)
	require.Zero(b, total%active, "open sessions must be a multiple of active ones")
	dir := requireAgent(b, "opencode")
	model := fakemodel.New()
	up := httptest.NewServer(model)
	b.Cleanup(up.Close)
	s := startSuiteWith(b, model, func(c *sandbox.Config) { c.AgentsDir, c.AgentModel = dir, "fake-model" })
	ctx := context.Background()
	// What the node's services hold per open session (they run in this
	// process): the Go heap after a collection, before and after the
	// sessions are opened; and the store's memory, which may live elsewhere.
	heap0, redis0 := liveHeap(), redisUsed(b, s)

	start := time.Now()
	ids := make([]string, total)
	sandboxes := make([]string, total)
	for wave := 0; wave < total/active; wave++ {
		last := wave == total/active-1
		profile := "scripted"
		if last {
			profile = "opencode"
		}
		g, gctx := errgroup.WithContext(ctx)
		for j := range active {
			i := wave*active + j
			g.Go(func() error {
				sess := s.createAgent(b, fmt.Sprintf("sbx-open-%d", i), fmt.Sprintf("/work/open-%d", i), newSecret(), profile)
				ids[i], sandboxes[i] = sess.GetSessionId(), sess.GetSandboxId()
				if err := s.answer(gctx, ids[i], "m1", "hello"); err != nil {
					return fmt.Errorf("session %d (%s): %w", i, profile, err)
				}
				if last {
					return nil
				}
				_, err := s.suspend(b, ids[i], false)
				return err
			})
		}
		require.NoError(b, g.Wait(), "wave %d", wave)
	}
	b.Logf("%d sessions opened, %d active, in %v", total, active, time.Since(start).Round(time.Second))

	// Only the active sandboxes run processes.
	for i, sbx := range sandboxes {
		pids, err := listWrapperPIDs(sbx)
		require.NoError(b, err)
		if i < total-active {
			require.Empty(b, pids, "suspended session %d runs no process", i)
		} else {
			require.NotEmpty(b, pids, "active session %d runs its agent", i)
		}
	}
	procs := sandboxprocs.Under(s.root)
	var pss int
	for _, pid := range procs {
		pss += pssKiB(pid)
	}
	perActive := float64(pss) / float64(active) / 1024
	b.Logf("sandbox processes: %d, PSS %.1f MiB in all, %.1f MiB per active session; %d suspended sessions: 0 processes",
		len(procs), float64(pss)/1024, perActive, total-active)
	b.ReportMetric(float64(pss)/1024, "MiB-sandboxes")
	b.ReportMetric(perActive, "MiB/active")
	b.ReportMetric(float64(len(procs)), "processes")
	heapPer, redisPer := float64(liveHeap()-heap0)/float64(total)/1024, float64(redisUsed(b, s)-redis0)/float64(total)/1024
	b.Logf("per open session: %.1f KiB of the services' Go heap, %.1f KiB of Redis memory", heapPer, redisPer)
	b.ReportMetric(heapPer, "KiB-heap/open")
	b.ReportMetric(redisPer, "KiB-redis/open")

	// A suspended session resumes on its next message.
	require.NoError(b, s.answer(ctx, ids[0], "m2", "hello again"))

	for _, id := range ids {
		s.deleteSession(b, id)
	}
	require.Eventually(b, func() bool { return len(sandboxprocs.Under(s.root)) == 0 }, 2*time.Minute, 200*time.Millisecond,
		"sandbox processes left after every session was deleted")
	for _, d := range []string{"workspaces", "homes"} {
		require.Eventually(b, func() bool { return emptyOrMissing(filepath.Join(s.root, d)) }, 2*time.Minute, 200*time.Millisecond,
			"%s left under the sandbox root after every session was deleted", d)
	}
}

// answer sends a message and waits for its turn to succeed, without
// assertions (it runs in a goroutine).
func (s *suite) answer(ctx context.Context, sessionID, messageID, content string) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	if _, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: sessionID, MessageId: messageID, Content: content}); err != nil {
		return err
	}
	stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sessionID})
	if err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return err
		}
		if o := resp.GetEvent().GetOutcome(); o != nil && o.GetLastMessageId() == messageID {
			if o.GetResult() != runtimev1.TurnResult_TURN_RESULT_SUCCEEDED {
				return fmt.Errorf("outcome %v", o)
			}
			return nil
		}
		if msg := resp.GetEvent().GetMessage(); msg.GetMessageId() == messageID && msg.GetState() == sessionv1.MessageState_MESSAGE_STATE_FAILED {
			return errors.New("message failed: " + msg.GetFailureReason())
		}
	}
}

// pssKiB is a process's proportional set size, 0 when it is gone.
func pssKiB(pid int) int { return procKiB(pid, "smaps_rollup", "Pss:") }

func emptyOrMissing(dir string) bool {
	ents, err := os.ReadDir(dir)
	return (err == nil && len(ents) == 0) || errors.Is(err, os.ErrNotExist)
}

func envCount(tb testing.TB, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	require.NoError(tb, err, name)
	require.Positive(tb, n, name)
	return n
}

// liveHeap is the bytes of this process's Go heap still reachable after a
// collection.
func liveHeap() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// redisUsed is the suite's Redis used_memory in bytes.
func redisUsed(b *testing.B, s *suite) int64 {
	info := s.redis.InfoMap(context.Background(), "memory")
	require.NoError(b, info.Err())
	n, err := strconv.ParseInt(info.Item("Memory", "used_memory"), 10, 64)
	require.NoError(b, err, "INFO memory's used_memory")
	return n
}

// BenchmarkSandboxShare (DESIGN.md 3.8, goal ≤ 10 MiB): agentplane's own
// memory beside a lone idle opencode sandbox — both bubblewraps and the
// wrapper — by bench/sandbox-pss.sh, the command an operator runs on a node,
// after one turn and a few quiet seconds. Reported: agentplane-MiB and
// agent-MiB (PSS). Run it with no other sandbox on the node: PSS divides the
// wrapper binary's pages among every wrapper running.
//
//	cd cmd/agentplane && go test ./e2e -run '^$' -bench '^BenchmarkSandboxShare$' -benchtime 1x
func BenchmarkSandboxShare(b *testing.B) {
	dir := requireAgent(b, "opencode")
	s := startSuiteWith(b, fakemodel.New(), func(c *sandbox.Config) { c.AgentsDir, c.AgentModel = dir, "fake-model" })
	sess := s.createAgent(b, "sbx-share", "/work/share", "sk-share", "opencode")
	s.turn(b, sess.GetSessionId(), "m1", "hello")
	time.Sleep(5 * time.Second) // idle: the turn's allocations collected, nothing running
	out, err := exec.Command("bash", "../../../bench/sandbox-pss.sh", sess.GetSandboxId()).CombinedOutput()
	require.NoError(b, err, "%s", out)
	b.Logf("bench/sandbox-pss.sh %s:\n%s", sess.GetSandboxId(), out)
	var ours, agent float64
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	_, err = fmt.Sscanf(lines[len(lines)-1], "agentplane %f MiB PSS, agent %f MiB PSS", &ours, &agent)
	require.NoError(b, err, "the script's last line: %q", lines[len(lines)-1])
	b.ReportMetric(ours, "agentplane-MiB")
	b.ReportMetric(agent, "agent-MiB")
	s.deleteSession(b, sess.GetSessionId())
}
