package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	sandbox "agentplane.dev/services/sandbox/server"
)

// messageFailure waits for messageID to end and returns its failure
// reason ("" when it succeeded).
func (s *suite) messageFailure(t testing.TB, sessionID, messageID string) string {
	t.Helper()
	var reason string
	require.Eventually(t, func() bool {
		m, err := s.ses.GetMessage(context.Background(), &sessionv1.GetMessageRequest{SessionId: sessionID, MessageId: messageID})
		require.NoError(t, err)
		reason = m.GetMessage().GetFailureReason()
		st := m.GetMessage().GetState()
		return st == sessionv1.MessageState_MESSAGE_STATE_FAILED || st == sessionv1.MessageState_MESSAGE_STATE_COMPLETED
	}, 90*time.Second, 100*time.Millisecond, "message %s ends", messageID)
	return reason
}

// TestSandboxMemoryHogStopsWithMemoryLimit (issue 31: one process touched
// 2 GiB, no limit held): a runtime's command that holds more than the
// sandbox's memory limit is ended by the kernel inside the sandbox's
// cgroup, the sandbox's runtime key is stopped, and the turn in flight
// fails with memory_limit. The next message gets a new runtime.
func TestSandboxMemoryHogStopsWithMemoryLimit(t *testing.T) {
	if ok, why := sandbox.CgroupLimits(); !ok {
		t.Fatalf("this test needs cgroup limits (cgroup v2 delegated, or v1 as root): %s", why)
	}
	s := startSuiteWith(t, nil, func(c *sandbox.Config) { c.MemoryLimit = 192 << 20 })
	sess := s.create(t, "sbx-mem", "/work/e2e-repo", newSecret())
	id := sess.GetSessionId()
	s.turn(t, id, "m1", "hello")

	// A process of the runtime holds 400 MiB (the scripted runtime keeps only a command's
	// last 4 KiB of output since 7d73ad3, so the hog is its own).
	s.turn(t, id, "w", "write: hog.sh "+memHog("mem-hog", 400))
	_, err := s.ses.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: id, MessageId: "m2",
		Content: "run: sh hog.sh"})
	require.NoError(t, err)
	got := s.messageFailure(t, id, "m2")
	if got != "memory_limit" {
		for _, l := range strings.Split(logsOf(s), "\n") {
			if strings.Contains(l, "cgroup") || strings.Contains(l, "limit") || strings.Contains(l, "isolation") {
				t.Log(l)
			}
		}
	}
	require.Equal(t, "memory_limit", got)

	s.turn(t, id, "m3", "hello again") // a new runtime serves the session
}

// TestSandboxDiskQuota (issue 31: one sandbox filled the shared root and
// other tenants' worktrees failed capacity_rejected): sandbox A writes past
// its disk quota; its runtime is stopped and its route then fails with
// disk_quota, while sandbox B's new worktree is admitted and its turn runs.
func TestSandboxDiskQuota(t *testing.T) {
	s := startSuiteWith(t, nil, func(c *sandbox.Config) { c.DiskQuota = 64 << 20 })
	a := s.create(t, "sbx-disk-a", "/work/e2e-repo", newSecret()).GetSessionId()
	requireDiskQuotaHolds(t, s, a, func() string { return s.create(t, "sbx-disk-b", "/work/e2e-repo", newSecret()).GetSessionId() })
}

// requireDiskQuotaHolds: session a's sandbox (quota 64 MiB) writes 100 MiB;
// its runtime is stopped and its route then fails with disk_quota, while
// the session newB creates (another sandbox) is admitted and its turn runs.
// The writing turn itself ends succeeded, or failed with disk_quota: the
// scripted runtime ends it as the write returns, an agent still calls its
// model after its tool, and the quota's sample may stop it before that.
func requireDiskQuotaHolds(t *testing.T, s *suite, a string, newB func() string) {
	t.Helper()
	s.turn(t, a, "m1", "hello")
	_, err := s.ses.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: a, MessageId: "m2",
		Content: "run: dd if=/dev/zero of=filler bs=1M count=100"})
	require.NoError(t, err)
	require.Contains(t, []string{"", "disk_quota"}, s.messageFailure(t, a, "m2"), "the writing turn succeeded or was stopped for the quota")

	// The quota is sampled: once it sees A over, A's runtime is stopped and
	// its route is no longer ready.
	require.Eventually(t, func() bool {
		return s.routeView(t, a).GetState() != sessionv1.RouteState_ROUTE_STATE_READY
	}, 90*time.Second, 100*time.Millisecond, "A's runtime is stopped for its quota")
	ctx := context.Background()
	_, err = s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: a, MessageId: "m3", Content: "hello"})
	require.NoError(t, err)
	ok := assert.Eventually(t, func() bool {
		return s.routeView(t, a).GetFailureReason() == "disk_quota"
	}, 90*time.Second, 100*time.Millisecond, "A's route fails with disk_quota")
	if !ok {
		t.Log(s.routeView(t, a))
		for _, l := range strings.Split(logsOf(s), "\n") {
			if strings.Contains(l, "quota") || strings.Contains(l, "limit") || strings.Contains(l, "admission") || strings.Contains(l, "route") {
				t.Log(l)
			}
		}
		t.FailNow()
	}
	require.NotEmpty(t, s.messageFailure(t, a, "m3"), "A's next message fails")

	b := newB()
	s.turn(t, b, "m1", "hello from another tenant")
}

// logsOf is the suite's captured log ("" when its services run as processes).
func logsOf(s *suite) string {
	if s.logs == nil {
		return ""
	}
	return s.logs.String()
}

// memHog is a shell command holding mib MiB until it is stopped (the memory
// hogs of the limits tests and benchmarks); its process is named name before
// it allocates (BEGIN: perl would fold a constant "a" x (N << 20) at compile
// time, before a plain $0 = ... runs).
func memHog(name string, mib int) string {
	return fmt.Sprintf(`perl -e 'BEGIN { $0 = "%s" } my $n = %d << 20; $x = "a" x $n; sleep 600'`, name, mib)
}
