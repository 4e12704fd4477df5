package server_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testaddr"
	"agentplane.dev/pkg/testenv"
	"agentplane.dev/services/sandbox/internal/node/provider/process"
	"agentplane.dev/services/sandbox/server"
)

var (
	hostileOnce sync.Once
	hostileBin  string
	hostileErr  error
)

// hostile builds testdata/hostile (a wrapper whose runtime attacks its
// boundary) next to the sandbox binary.
func hostile(t *testing.T) string {
	t.Helper()
	hostileOnce.Do(func() {
		hostileBin = filepath.Join(filepath.Dir(binPath), "hostile")
		out, err := exec.Command("go", "build", "-o", hostileBin, "./testdata/hostile").CombinedOutput()
		if err != nil {
			hostileErr = fmt.Errorf("build hostile runtime: %w: %s", err, out)
		}
	})
	require.NoError(t, hostileErr)
	return hostileBin
}

// targets writes what the hostile runtime of (sandbox, dir) attacks into its
// workspace before the route exists.
func targets(t *testing.T, root, sandbox, dir string, v any) string {
	t.Helper()
	ws := filepath.Join(root, sandbox, "workspaces", process.WorkspaceName(dir))
	require.NoError(t, os.MkdirAll(ws, 0o755))
	b, err := json.Marshal(v)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(ws, "targets.json"), b, 0o644))
	return ws
}

func report(t *testing.T, ws string) map[string]string {
	t.Helper()
	var rep map[string]string
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(filepath.Join(ws, "hostile-report.json"))
		return err == nil && json.Unmarshal(b, &rep) == nil
	}, 60*time.Second, 20*time.Millisecond, "the hostile runtime never reported")
	return rep
}

// The hostile-runtime e2e of issue 16: a runtime that tries to read
// another process's environ or memory (a service's, another sandbox's
// wrapper's), another sandbox's files and the sandbox root's, to connect to
// Redis, to a service's gRPC port, to an HTTP server on host loopback and to
// the proxy's real address, to signal a process outside and to raise its
// limits — every attempt fails — and that reaches the model provider through
// proxy_url and gets the answer.
func TestHostileRuntimeIsContained(t *testing.T) {
	bin := hostile(t)
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "provider answer for "+r.URL.Path)
	}))
	defer provider.Close()
	hostHTTP := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "host secret") }))
	defer hostHTTP.Close()

	n := startNotify(t)
	svc := startService(t, n.addr, func(c *server.Config) {
		c.WrapperCommand = []string{bin, "wrapper"}
		c.ProxyURL = provider.URL
	})

	// A neighbour sandbox with a file and a wrapper of its own.
	nb := uniqueSandbox(t)
	nws := targets(t, svc.root, nb, "/repo/neighbour", map[string]any{})
	require.NoError(t, os.WriteFile(filepath.Join(nws, "secret.txt"), []byte("neighbour secret"), 0o644))
	waitReady(t, svc, n, 0, route(nb, "n1", "/repo/neighbour"))
	nOuter, nInner := wrappersOf(t, nb), innerWrappersOf(t, nb)
	require.Len(t, nOuter, 1)
	require.Len(t, nInner, 1)
	nbLogs, _ := filepath.Glob(filepath.Join(svc.root, nb, "logs", "*.log"))
	nbRecords, _ := filepath.Glob(filepath.Join(svc.root, nb, "run", "*.json"))
	require.NotEmpty(t, nbLogs)
	require.NotEmpty(t, nbRecords)

	sb := uniqueSandbox(t)
	redisAddr := strings.TrimPrefix(redisSrv.URL(), "redis://")
	if i := strings.LastIndexByte(redisAddr, '/'); i > 0 {
		redisAddr = redisAddr[:i]
	}
	ws := targets(t, svc.root, sb, "/repo/hostile", map[string]any{
		"pids":  []int{os.Getpid(), nOuter[0].PID, nInner[0].PID},
		"files": []string{filepath.Join(nws, "secret.txt"), nbLogs[0], nbRecords[0], filepath.Join(svc.root, sb, "logs")},
		"addrs": []string{redisAddr, svc.addr, hostHTTP.Listener.Addr().String(), provider.Listener.Addr().String()},
	})
	_, i := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/hostile"))
	rep := report(t, ws)
	t.Logf("hostile report: %v", rep)

	for _, k := range []string{"proxy", "uid", "rlimit nofile"} {
		require.Contains(t, rep, k)
	}
	attempts := 0
	for k, v := range rep {
		switch k {
		case "proxy", "uid", "rlimit nofile":
			continue
		}
		attempts++
		require.True(t, strings.HasPrefix(v, "failed: "), "%s succeeded from inside the sandbox: %s", k, v)
	}
	require.GreaterOrEqual(t, attempts, 3*4+5+1+5+2, "every attack ran: pids, files, /usr, addresses, limits")
	for _, pid := range []int{os.Getpid(), nOuter[0].PID, nInner[0].PID} {
		require.Contains(t, rep[fmt.Sprintf("read /proc/%d/environ", pid)], "no such file", "processes outside are not even visible")
		require.Contains(t, rep[fmt.Sprintf("signal %d", pid)], "no such process")
	}
	require.Contains(t, rep["raise rlimit nofile"], "operation not permitted")
	require.Equal(t, "1024/1024", rep["rlimit nofile"], "the default SANDBOX_RLIMITS hold")
	if os.Geteuid() == 0 {
		require.Equal(t, "65534", rep["uid"], "a root service runs sandboxes as nobody")
	}
	require.Equal(t, "ok: provider answer for /s/"+sb+"/provider/v1/messages", rep["proxy"], "the proxy is reachable through proxy_url")

	// The runtime still works: a turn completes.
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m1", "hello"))
	out, _ := n.wait(t, i, "outcome", "s1")
	require.Equal(t, "TURN_RESULT_SUCCEEDED", out.Reason)
}

// The supervisor out of the agent's reach (issue 31, DESIGN.md 3.3): from
// inside, the runtime enumerates every process it can see, reads each
// one's environ and memory and looks for a launch credential, and sends
// SIGSTOP to any that is a wrapper. It sees no wrapper (the runtime runs in
// a nested sandbox whose PID namespace holds only its own processes), no
// credential anywhere, and its parent is the nested sandbox's init; the
// wrapper is non-dumpable besides (its /proc files are host root's), never
// stopped, and the turn completes.
func TestSupervisorOutOfReach(t *testing.T) {
	bin := hostile(t)
	n := startNotify(t)
	svc := startService(t, n.addr, func(c *server.Config) { c.WrapperCommand = []string{bin, "wrapper"} })
	sb := uniqueSandbox(t)
	ws := targets(t, svc.root, sb, "/repo/supervisor", map[string]any{"supervisor": true})
	_, i := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/supervisor"))
	var rep supervisorReport
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(filepath.Join(ws, "supervisor-report.json"))
		return err == nil && json.Unmarshal(b, &rep) == nil
	}, 60*time.Second, 20*time.Millisecond, "the hostile runtime never reported")
	t.Logf("what the runtime sees: self %d, parent %q, others %v, environ %v, memory %v", rep.Self, rep.Parent, rep.Visible, rep.Environ, rep.Mem)
	rep.requireNothingInReach(t)
	requireWrapperIntact(t, sb)

	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m1", "hello"))
	out, _ := n.wait(t, i, "outcome", "s1")
	require.Equal(t, "TURN_RESULT_SUCCEEDED", out.Reason)
}

// A pooled wrapper's runtime starts before the claim, bound to no sandbox
// (DESIGN.md 3.3, 3.8): a hostile one attacks its supervisor then, from the
// pool. It sees no wrapper to read, trace or stop, and no credential (the
// launch credential arrives with the claim, after it looked); the claim
// hands the pooled sandbox to the route, the turn completes, and the
// wrapper, non-dumpable from its start, was never stopped.
func TestPooledSupervisorOutOfReachBeforeItsClaim(t *testing.T) {
	bin := hostile(t)
	n := startNotify(t)
	metrics := testaddr.Addr(t)
	svc := startService(t, n.addr, func(c *server.Config) {
		c.WrapperCommand = []string{bin, "wrapper"}
		c.Pool, c.PoolDirectory, c.MetricsAddr = "scripted=1", "/repo/pooled", metrics
	})
	var reportFile string
	require.Eventually(t, func() bool {
		found, _ := filepath.Glob(filepath.Join(svc.root, ".pool-*", "workspaces", "*", "supervisor-report.json"))
		if len(found) == 1 {
			reportFile = found[0]
		}
		return reportFile != "" && poolReady(metrics) == 1
	}, 60*time.Second, 20*time.Millisecond, "the pooled hostile runtime never reported, or its wrapper never said it is ready")
	poolID := strings.Split(strings.TrimPrefix(reportFile, svc.root+"/"), "/")[0]
	// A claimed wrapper keeps its pool's marker (decision 70): the harness
	// finds it by that one.
	t.Cleanup(func() { killSandbox(poolID) })
	var rep supervisorReport
	b, err := os.ReadFile(reportFile)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &rep))
	rep.requireNothingInReach(t)

	sb := uniqueSandbox(t)
	_, i := waitReady(t, svc, n, 0, route(sb, "s1", "/repo/pooled"))
	ws := filepath.Join(svc.root, sb, "workspaces", process.WorkspaceName("/repo/pooled"))
	require.FileExists(t, filepath.Join(ws, "supervisor-report.json"), "the route took the pooled sandbox, its workspace and all")
	requireWrapperIntact(t, poolID) // a claimed wrapper keeps the pool's marker
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc, sb, "s1", "m1", "hello"))
	out, _ := n.wait(t, i, "outcome", "s1")
	require.Equal(t, "TURN_RESULT_SUCCEEDED", out.Reason)
}

// supervisorReport is what the hostile runtime saw of its supervisor
// (testdata/hostile SupervisorReport).
type supervisorReport struct {
	Self    int               `json:"self"`
	Parent  string            `json:"parent"`
	Visible map[int]string    `json:"visible"`
	Environ map[int]string    `json:"environ"`
	Mem     map[int]string    `json:"mem"`
	Cred    []int             `json:"cred"`
	Stop    map[int]string    `json:"stop"`
	Errors  map[string]string `json:"errors"`
}

// requireNothingInReach: the runtime saw its nested sandbox only, no
// wrapper to stop and no launch credential anywhere.
func (rep supervisorReport) requireNothingInReach(t *testing.T) {
	t.Helper()
	require.Empty(t, rep.Errors)
	require.NotEmpty(t, rep.Visible, "it sees at least its nested sandbox's init and its own child")
	for pid, cmd := range rep.Visible {
		args := strings.Fields(cmd)
		require.False(t, len(args) > 1 && args[1] == "wrapper", "pid %d, visible from inside, is a wrapper: %q", pid, cmd)
	}
	require.Empty(t, rep.Stop, "no wrapper to stop")
	require.Empty(t, rep.Cred, "a launch credential is readable from inside")
	require.Equal(t, "bwrap", filepath.Base(strings.Fields(rep.Parent + " x")[0]), "the runtime's parent is its nested sandbox's init, not the wrapper: %q", rep.Parent)
}

// requireWrapperIntact: the one wrapper carrying marker is non-dumpable
// (its /proc files are root's, which its sandbox does not map) and was
// never stopped.
func requireWrapperIntact(t *testing.T, marker string) {
	t.Helper()
	inner := innerWrappersOf(t, marker)
	require.Len(t, inner, 1)
	st, err := os.Stat("/proc/" + strconv.Itoa(inner[0].PID) + "/environ")
	require.NoError(t, err)
	require.Equal(t, uint32(0), st.Sys().(*syscall.Stat_t).Uid, "the wrapper is non-dumpable")
	require.NotEqual(t, "T", stateOf(inner[0].PID), "the wrapper was never stopped")
}

// poolReady reads agentplane_sandbox_pool_size from a service's metrics
// (-1 when they cannot be read).
func poolReady(addr string) int {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, `agentplane_sandbox_pool_size{profile="scripted"} `); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				return -1
			}
			return n
		}
	}
	return -1
}

func stateOf(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return f[0]
}

// leftovers names every process of a sandbox's wrapper (its bubblewrap and
// every process descending from it: the wrapper's PID namespace and the
// agent's nested one) by pid and start time.
func leftovers(t *testing.T, sandbox string) map[int]string {
	t.Helper()
	ws := wrappersOf(t, sandbox)
	require.Len(t, ws, 1)
	all := procs(t)
	snap := map[int]string{ws[0].PID: startOf(ws[0].PID)}
	for grew := true; grew; {
		grew = false
		for _, p := range all {
			if _, in := snap[p.PPID]; in && snap[p.PID] == "" {
				snap[p.PID], grew = startOf(p.PID), true
			}
		}
	}
	return snap
}

func startOf(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	if len(f) < 20 || f[0] == "Z" {
		return ""
	}
	return f[19]
}

func stillRunning(snap map[int]string) []int {
	var left []int
	for pid, start := range snap {
		if s := startOf(pid); s != "" && s == start {
			left = append(left, pid)
		}
	}
	return left
}

// leaseOf is the lease of the sandbox's one runtime key; a sandbox whose
// key went with its last session (issue 32: its records are removed once
// it is verified absent) has none, which reads as NONE.
func leaseOf(t *testing.T, svc *service, sandbox string) sandboxv1.LeaseState {
	st, err := svc.client.Status(context.Background(), &sandboxv1.StatusRequest{Tenant: testTenant, SandboxId: sandbox})
	require.NoError(t, err)
	for _, k := range st.GetSandbox().GetRuntimeKeys() {
		return k.GetLeaseState()
	}
	return sandboxv1.LeaseState_LEASE_STATE_NONE
}

// Leak tests of issue 16: a runtime that leaves `sleep 600 &`, `setsid
// sleep 600 &`, a double fork and a process without environment behind.
// Once the service holds the runtime key absent — after the release of the
// last session, after an idle stop, after kill -9 of the wrapper — a scan of
// host /proc finds no process of it.
func TestNoProcessOutlivesItsRuntimeKey(t *testing.T) {
	bin := hostile(t)
	cases := map[string]struct {
		idle time.Duration
		act  func(t *testing.T, svc *service, sb string)
	}{
		"release": {act: func(t *testing.T, svc *service, sb string) {
			require.Eventually(t, func() bool {
				rel, err := svc.client.ReleaseRoute(context.Background(), &sandboxv1.ReleaseRouteRequest{Tenant: testTenant, SandboxId: sb, SessionId: "s1", Reason: "session-delete"})
				require.NoError(t, err)
				return rel.GetAbsenceVerified()
			}, 60*time.Second, 100*time.Millisecond)
		}},
		"idle": {idle: 2 * time.Second, act: func(*testing.T, *service, string) {}},
		"kill9": {act: func(t *testing.T, _ *service, sb string) {
			inner := innerWrappersOf(t, sb)
			require.Len(t, inner, 1)
			require.NoError(t, syscall.Kill(inner[0].PID, syscall.SIGKILL))
		}},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			n := startNotify(t)
			svc := startService(t, n.addr, func(cfg *server.Config) {
				cfg.WrapperCommand = []string{bin, "wrapper"}
				if c.idle > 0 {
					cfg.Timers.IdleStop = c.idle
				}
			})
			sb := uniqueSandbox(t)
			ws := targets(t, svc.root, sb, "/repo/leak", map[string]any{"leak": true})
			waitReady(t, svc, n, 0, route(sb, "s1", "/repo/leak"))
			require.Equal(t, "ok", report(t, ws)["leak"])
			var snap map[int]string
			require.Eventually(t, func() bool { snap = leftovers(t, sb); return len(snap) >= 8 }, 20*time.Second, 20*time.Millisecond,
				"bubblewrap, its init, the wrapper, the hostile runtime, the scripted one and four sleeps")
			require.Equal(t, sandboxv1.LeaseState_LEASE_STATE_OWNS_WRAPPER, leaseOf(t, svc, sb))

			c.act(t, svc, sb)
			require.Eventually(t, func() bool { return leaseOf(t, svc, sb) == sandboxv1.LeaseState_LEASE_STATE_NONE }, 60*time.Second, 50*time.Millisecond,
				"the service verifies the runtime key absent")
			require.Empty(t, stillRunning(snap), "processes of the runtime key outlived its verified absence")
		})
	}
}

// A workspace that cannot be prepared (the sandbox's tree is read-only)
// fails the route with sandbox_recovering, retryably; once the tree is
// writable again the next preparation recovers (DESIGN 3.4).
func TestUnwritableWorkspaceFailsTheRouteAndRecovers(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, nil)
	sb := uniqueSandbox(t)
	dir := filepath.Join(svc.root, sb)
	for _, d := range []string{"workspaces", "homes", "logs"} {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, d), 0o755)) // the sandbox exists; its new workspace cannot
	}
	if out, err := exec.Command("mount", "--bind", "-o", "ro", dir, dir).CombinedOutput(); err != nil {
		testenv.Missing(t, "read-only bind mount: %v: %s", err, out)
	}
	mounted := true
	unmount := func() {
		if mounted {
			out, err := exec.Command("umount", dir).CombinedOutput()
			require.NoError(t, err, "umount: %s", out)
			mounted = false
		}
	}
	t.Cleanup(unmount)
	// The bind mount may not be read-only on the first step on old
	// util-linux: make sure.
	if err := os.WriteFile(filepath.Join(dir, "probe"), nil, 0o644); err == nil {
		out, err := exec.Command("mount", "-o", "remount,bind,ro", dir).CombinedOutput()
		require.NoError(t, err, "remount ro: %s", out)
		_ = os.Remove(filepath.Join(dir, "probe"))
	}

	_, err := svc.client.Prepare(context.Background(), route(sb, "s1", "/repo/ro"))
	require.NoError(t, err)
	failed, i := n.wait(t, 0, "failed", "s1")
	require.Equal(t, "sandbox_recovering", failed.Reason)
	require.Empty(t, wrappersOf(t, sb), "nothing runs for a route that could not be prepared")

	unmount()
	_, err = svc.client.Prepare(context.Background(), route(sb, "s1", "/repo/ro"))
	require.NoError(t, err)
	n.wait(t, i, "ready", "s1")
}

// Two deployments on one host (their own Redis and sandbox root, the same
// org, user and so sandbox id): sessions in both run to completion, and
// stopping one's runtime key, or its leak sweep, never touches the other's
// wrapper.
func TestTwoDeploymentsSameSandboxIDDoNotTouch(t *testing.T) {
	n1, n2 := startNotify(t), startNotify(t)
	redis2 := redistest.Start(t)
	svc1 := startService(t, n1.addr, nil)
	svc2 := startService(t, n2.addr, func(c *server.Config) { c.RedisURL = redis2.URL() })
	sb := uniqueSandbox(t)
	_, i1 := waitReady(t, svc1, n1, 0, route(sb, "s1", "/repo/same"))
	_, i2 := waitReady(t, svc2, n2, 0, route(sb, "s1", "/repo/same"))
	all := wrappersOf(t, sb)
	require.Len(t, all, 2, "one wrapper per deployment")

	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc1, sb, "s1", "m1", "hello one"))
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc2, sb, "s1", "m1", "hello two"))
	o1, _ := n1.wait(t, i1, "outcome", "s1")
	o2, _ := n2.wait(t, i2, "outcome", "s1")
	require.Equal(t, "TURN_RESULT_SUCCEEDED", o1.Reason)
	require.Equal(t, "TURN_RESULT_SUCCEEDED", o2.Reason)

	// Deployment 2 releases its session: only its wrapper goes.
	require.Eventually(t, func() bool {
		rel, err := svc2.client.ReleaseRoute(context.Background(), &sandboxv1.ReleaseRouteRequest{Tenant: testTenant, SandboxId: sb, SessionId: "s1", Reason: "session-delete"})
		require.NoError(t, err)
		return rel.GetAbsenceVerified()
	}, 60*time.Second, 100*time.Millisecond)
	left := wrappersOf(t, sb)
	require.Len(t, left, 1)
	require.Equal(t, svc1.root, left[0].Env["AGENTPLANE_SANDBOX_ROOT"], "deployment 1's wrapper survives")
	require.Equal(t, sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT, deliver(t, svc1, sb, "s1", "m2", "still here"))
	_, _ = n1.wait(t, i1, "outcome", "s1")
}
