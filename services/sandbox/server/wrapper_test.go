package server_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/server"
)

// A wrapper killed with -9 is noticed; its route goes reconnecting, then
// lost; the next preparation brings a new wrapper whose RouteReady names a
// new instance (the session service fails old accepted work with
// agent_restarted on it).
func TestWrapperKilledRouteLostThenNewInstance(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, nil)
	sb := uniqueSandbox(t)

	first, i := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/k"))
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m1", "slow: a long turn"))
	ws := wrappersOf(t, sb)
	require.Len(t, ws, 1)
	oldInstances := instancesOf(ws)
	require.Len(t, runtimesOf(t, oldInstances), 1)

	inner := innerWrappersOf(t, sb)
	require.Len(t, inner, 1)
	require.NoError(t, syscall.Kill(inner[0].PID, syscall.SIGKILL), "kill -9 of the wrapper itself")
	_, ri := n.wait(t, i, "reconnecting", "s1")
	lost, li := n.wait(t, ri, "lost", "s1")
	require.NotEmpty(t, lost.Reason)
	// The runtime of the killed wrapper dies with it (parent-death signal).
	require.Eventually(t, func() bool { return len(runtimeTreesOf(t, oldInstances)) == 0 }, 30*time.Second, 50*time.Millisecond)

	// Not ready now: nothing is written.
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_NOT_READY, deliver(t, svc, sb, "s1", "m2", "hi"))

	second, _ := waitReady(t, svc, n, li, route(sb, "s1", "/repo/k"))
	require.NotEqual(t, first.Instance, second.Instance, "RouteReady names the new wrapper instance")
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m3", "after restart"))
	n.wait(t, li, "outcome", "s1")
}

// A Hello with a stale allocation or a forged credential gets Shutdown and
// the wrapper exits 0. No launch credential is in any process's environ or
// command line.
func TestHelloRejectedAndCredentialNeverExposed(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, nil)
	sb := uniqueSandbox(t)
	waitReady(t, svc, n, 0, route(sb, "s1", "/repo/h"))
	st, err := svc.client.Status(context.Background(), &sandboxv1.StatusRequest{Tenant: testTenant, SandboxId: sb})
	require.NoError(t, err)
	alloc := st.GetSandbox().GetAllocationId()
	require.NotEmpty(t, alloc)

	run := func(allocation string) (string, string) {
		raw := make([]byte, 24)
		_, _ = rand.Read(raw)
		forged := "aplc_" + hex.EncodeToString(raw)
		credFile := filepath.Join(t.TempDir(), "cred")
		require.NoError(t, os.WriteFile(credFile, []byte(forged), 0o600))
		cmd := exec.Command(binPath, "wrapper", "--control-addr", svc.addr, "--allocation", allocation,
			"--fence-token", "1", "--credential-file", credFile)
		cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "AGENTPLANE_SANDBOX=" + sb, "AGENTPLANE_RUNTIME_KEY=/repo/h",
			"AGENTPLANE_INSTANCE=forged-" + allocation, "AGENTPLANE_GENERATION=1"}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Run(), "the wrapper exits 0 on Shutdown: %s", stderr.String())
		_, err := os.Stat(credFile)
		require.True(t, os.IsNotExist(err), "the credential file is deleted after reading")
		require.NotContains(t, stderr.String(), forged)
		return stderr.String(), forged
	}
	out, forged := run(alloc)
	require.Contains(t, out, "SHUTDOWN_REASON_BAD_CREDENTIAL")
	stale, _ := run("alloc_stale")
	require.Contains(t, stale, "SHUTDOWN_REASON_STALE_ALLOCATION")

	// The real wrapper still serves: the forged Hello did not displace it.
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m1", "still here"))

	// Scan every process: no launch credential (all carry the aplc_ prefix)
	// in environ or cmdline, real or forged.
	ws := wrappersOf(t, sb)
	require.Len(t, ws, 1)
	for _, p := range procs(t) {
		for _, b := range [][]byte{p.RawEnv, p.Cmdline} {
			require.False(t, bytes.Contains(b, []byte("aplc_")), "pid %d exposes a launch credential", p.PID)
			require.False(t, bytes.Contains(b, []byte(forged)))
		}
	}
	// The wrapper's fd 3 was consumed and closed (in its bubblewrap too).
	for _, w := range append(ws, innerWrappersOf(t, sb)...) {
		if link, err := os.Readlink(filepath.Join("/proc", itoa(w.PID), "fd", "3")); err == nil {
			require.False(t, strings.HasPrefix(link, "pipe:"), "credential pipe still open in pid %d: %s", w.PID, link)
		}
	}
}

// With the control plane gone, a wrapper stops its runtime and exits after
// the reconnect window, leaving no process.
func TestWrapperExitsAfterReconnectWindow(t *testing.T) {
	n := startNotify(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	svc, stop := startStoppableService(t, ctx, n.addr, func(c *server.Config) { c.Timers.ReconnectWindow = 2 * time.Second })
	sb := uniqueSandbox(t)
	waitReady(t, svc, n, 0, route(sb, "s1", "/repo/g"))
	ws := wrappersOf(t, sb)
	require.Len(t, ws, 1)
	inst := instancesOf(ws)
	require.Len(t, runtimesOf(t, inst), 1)

	stop() // the control plane is gone
	require.Eventually(t, func() bool {
		return len(wrappersOf(t, sb)) == 0 && len(runtimeTreesOf(t, inst)) == 0
	}, 60*time.Second, 100*time.Millisecond, "wrapper and runtime exit after the reconnect window")
}

// A wrapper that stops heartbeating while its stream stays open (SIGSTOP:
// the process and its TCP connection live on) is noticed by heartbeat loss
// alone: the route goes reconnecting after DeadAfter, then lost when the
// reconnect window expires, and the stop escalates to SIGKILL so no process
// is left.
func TestWrapperHeartbeatLossRouteReconnectingThenLost(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, func(c *server.Config) {
		c.Timers.Heartbeat = 200 * time.Millisecond
		c.Timers.DeadAfter = time.Second
		// Long enough that the checks right after reconnecting run
		// before the window's stop touches the wrapper.
		c.Timers.ReconnectWindow = 4 * time.Second
	})
	sb := uniqueSandbox(t)

	_, i := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/hb"))
	ws := wrappersOf(t, sb)
	require.Len(t, ws, 1)
	inner := innerWrappersOf(t, sb)
	require.Len(t, inner, 1)
	pid := inner[0].PID // pause the wrapper itself, not its bubblewrap
	inst := instancesOf(ws)
	require.Len(t, runtimesOf(t, inst), 1)

	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	t.Cleanup(func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		_ = syscall.Kill(pid, syscall.SIGCONT)
	})
	require.Eventually(t, func() bool { return procState(pid) == "T" }, 30*time.Second, 10*time.Millisecond, "wrapper stopped")

	_, ri := n.wait(t, i, "reconnecting", "s1")
	// The wrapper is still there, stopped, its connection open: no stream
	// close told the service; the missing heartbeats did (the slot, written
	// before the notification, says so).
	require.Equal(t, "T", procState(pid), "reconnecting while the wrapper process still exists")
	snap, err := store.Load(context.Background(), redisSrv.Client(t), sb)
	require.NoError(t, err)
	require.Len(t, snap.KeyAllocations, 1)
	for _, s := range snap.KeyAllocations {
		require.Equal(t, allocation.Disconnected, s.Alloc.Phase)
		require.Equal(t, allocation.ReasonHeartbeatLost, s.Alloc.Reason)
	}

	lost, _ := n.wait(t, ri, "lost", "s1")
	require.Equal(t, allocation.ReasonReconnectWindow, lost.Reason, "a live (stopped) wrapper is lost by the window, not by its exit")

	// The stop escalates to SIGKILL, which a stopped process cannot ignore.
	require.Eventually(t, func() bool {
		return len(wrappersOf(t, sb)) == 0 && len(runtimeTreesOf(t, inst)) == 0
	}, 60*time.Second, 100*time.Millisecond, "wrapper and runtime gone after the stop")
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_NOT_READY, deliver(t, svc, sb, "s1", "m1", "hi"))
}

// procState is the state letter of pid in /proc/<pid>/stat ("" when gone).
func procState(pid int) string {
	stat, err := os.ReadFile(filepath.Join("/proc", itoa(pid), "stat"))
	if err != nil {
		return ""
	}
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return ""
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}
