package process

import (
	"context"
	"encoding/json"
	"fmt"
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

	"agentplane.dev/pkg/pause"
	"agentplane.dev/pkg/testenv"
	"agentplane.dev/services/sandbox/internal/node/boundary"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// newProvider isolates like the service does by default.
func newProvider(t *testing.T) *Provider {
	t.Helper()
	p, err := New(Config{Root: t.TempDir(), Isolation: isolation(t)})
	require.NoError(t, err)
	return p
}

// isolation is the boundary of the tests: bubblewrap from PATH, the
// service's own uid (the test binary is not readable by another), no
// sockets. A missing bubblewrap fails under CI=true.
func isolation(t *testing.T) *boundary.Config {
	t.Helper()
	bw, err := boundary.FindBwrap(os.Getenv("AGENTPLANE_SANDBOX_BWRAP"))
	if err != nil {
		testenv.Missing(t, "bubblewrap: %v", err)
	}
	c := &boundary.Config{Bwrap: bw, UID: -1, GID: -1}
	require.NoError(t, c.Probe(context.Background(), "", ""))
	return c
}

func launch(t *testing.T, p *Provider, sb, key, inst, mode, workspace string) provider.Observed {
	t.Helper()
	o, err := p.Launch(context.Background(), provider.LaunchSpec{
		Markers:   provider.Markers{SandboxID: sb, RuntimeKey: key, InstanceID: inst, Generation: 7},
		Path:      os.Args[0],
		Env:       []string{"HELPER_MODE=" + mode, provider.EnvSandbox + "=forged"},
		Workspace: workspace,
	})
	require.NoError(t, err)
	ready := filepath.Join(p.WorkspaceDir(sb, workspace), "ready")
	require.Eventually(t, func() bool { _, err := os.Stat(ready); return err == nil }, 20*time.Second, 10*time.Millisecond)
	require.NoError(t, os.Remove(ready))
	return o
}

// sandboxID is unique per test run, so processes of other runs never
// match; cleanup stops whatever a failed test left behind.
func sandboxID(t *testing.T, p *Provider) string {
	t.Helper()
	sb := "t" + strconv.FormatInt(time.Now().UnixNano(), 36)
	t.Cleanup(func() {
		for _, id := range []string{sb, sb + "0"} {
			if sd := p.DiscoverSandbox(context.Background(), id); sd.Kind == provider.Present {
				for k := range sd.ByRuntimeKey {
					p.Stop(context.Background(), provider.StopTarget{SandboxID: id, RuntimeKey: k})
				}
			}
		}
		p.Wait()
	})
	return sb
}

// alive checks /proc directly: a pid is alive unless missing or a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	return !strings.HasPrefix(strings.TrimSpace(s[strings.LastIndexByte(s, ')')+1:]), "Z")
}

func TestLaunchDiscoverStopExactKeys(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	ctx := context.Background()
	a1 := launch(t, p, sb, "a", "i1", "sleep", "/work/repo")
	a2 := launch(t, p, sb, "a2", "i2", "sleep", "/work/repo2")
	other := launch(t, p, sb+"0", "a", "i3", "sleep", "/work/repo")

	env, err := os.ReadFile("/proc/" + strconv.Itoa(a1.PID) + "/environ")
	require.NoError(t, err)
	vars := parseEnviron(env)
	require.Equal(t, sb, vars[provider.EnvSandbox], "launch markers win over spec.Env")
	require.Equal(t, "a", vars[provider.EnvRuntimeKey])
	require.Equal(t, "i1", vars[provider.EnvInstance])
	require.Equal(t, "7", vars[provider.EnvGeneration])
	require.Equal(t, p.HomeDir(sb, "a"), vars["HOME"], "the home is the runtime key's")
	cwd, err := os.Readlink("/proc/" + strconv.Itoa(a1.PID) + "/cwd")
	require.NoError(t, err)
	require.Equal(t, p.WorkspaceDir(sb, "/work/repo"), cwd)
	pgid, err := syscall.Getpgid(a1.PID)
	require.NoError(t, err)
	require.Equal(t, a1.PID, pgid, "own process group")

	d := p.Discover(ctx, sb, "a")
	require.Equal(t, provider.Present, d.Kind)
	require.Len(t, d.Observed, 1, "key a never matches a2, sandbox sb1 never matches sb10")
	require.Equal(t, a1.PID, d.Observed[0].PID)
	require.Equal(t, "i1", d.Observed[0].InstanceID)
	require.Equal(t, uint64(7), d.Observed[0].Generation)
	require.Equal(t, provider.Absent, p.Discover(ctx, sb, "").Kind)
	require.Equal(t, provider.Absent, p.Discover(ctx, sb[:len(sb)-1], "a").Kind)

	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb, RuntimeKey: "a", InstanceID: "other"}).Kind)
	require.True(t, alive(a1.PID), "instance-targeted stop leaves other instances")
	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb, RuntimeKey: "a"}).Kind)
	require.False(t, alive(a1.PID))
	require.True(t, alive(a2.PID))
	require.True(t, alive(other.PID))
	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb, RuntimeKey: "a2"}).Kind)
	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb + "0", RuntimeKey: "a"}).Kind)
	require.False(t, alive(a2.PID) || alive(other.PID))
	p.Wait()
}

func TestStopEscalatesToSIGKILL(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	var mu sync.Mutex
	var waits []time.Duration
	p.cfg.Sleep = func(ctx context.Context, d time.Duration) error {
		mu.Lock()
		waits = append(waits, d)
		mu.Unlock()
		return pause.Sleep(ctx, d)
	}
	o := launch(t, p, sb, "k", "i", "ignore-term", "/w")
	res := p.Stop(context.Background(), provider.StopTarget{SandboxID: sb, RuntimeKey: "k"})
	require.Equal(t, provider.StopAbsent, res.Kind, "%v", res.Err)
	require.False(t, alive(o.PID))
	require.Equal(t, []time.Duration{100 * time.Millisecond, 400 * time.Millisecond, 500 * time.Millisecond, KillSettle}, waits,
		"observed at 100 ms, 500 ms, 1 s after SIGTERM, then once after SIGKILL")
	p.Wait()
}

func TestUnmarkedWrapperIsFound(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	require.NoError(t, p.Create(context.Background(), sb))
	cmd := exec.Command(os.Args[0])
	cmd.Dir = t.TempDir()
	cmd.Env = []string{"HELPER_MODE=sleep", provider.EnvSandbox + "=" + sb, provider.EnvRuntimeKey + "=k",
		provider.EnvDeployment + "=" + p.cfg.Deployment, provider.EnvSandboxRoot + "=" + p.cfg.Root}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	require.Eventually(t, func() bool { _, err := os.Stat(filepath.Join(cmd.Dir, "ready")); return err == nil }, 20*time.Second, 10*time.Millisecond)

	d := p.Discover(context.Background(), sb, "k")
	require.Equal(t, provider.Present, d.Kind)
	require.Len(t, d.Observed, 1)
	require.True(t, d.Observed[0].Unmarked)
	sd := p.DiscoverSandbox(context.Background(), sb)
	require.Equal(t, provider.Present, sd.Kind)
	require.Len(t, sd.ByRuntimeKey["k"], 1)
	require.Equal(t, provider.StopAbsent, p.Stop(context.Background(), provider.StopTarget{SandboxID: sb, RuntimeKey: "k"}).Kind)
	<-done
}

// fp is one process of a fake /proc: its parent, how many PID namespaces
// below the /proc's it runs, its environment ("": no environ file, as for a
// process that vanished mid-scan; unreadable: reading fails, as for a
// non-dumpable process) and its state.
type fp struct {
	ppid, depth int
	env, state  string
}

const unreadable = "<unreadable>"

// fakeSelf is the pid of the service in every fake /proc.
const fakeSelf = 1000

// fakeProc builds a /proc-like tree of procs plus the service itself
// (fakeSelf, at depth 0, its own environ unreadable: it is non-dumpable).
func fakeProc(t *testing.T, procs map[int]fp) string {
	t.Helper()
	root := t.TempDir()
	procs[fakeSelf] = fp{ppid: 1, env: unreadable}
	for pid, p := range procs {
		dir := filepath.Join(root, strconv.Itoa(pid))
		require.NoError(t, os.MkdirAll(filepath.Join(dir, "ns"), 0o755))
		switch p.env {
		case unreadable:
			require.NoError(t, os.Mkdir(filepath.Join(dir, "environ"), 0o755)) // reading fails with EISDIR
		case "":
		default:
			require.NoError(t, os.WriteFile(filepath.Join(dir, "environ"), []byte(p.env), 0o644))
		}
		state := p.state
		if state == "" {
			state = "S"
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, "stat"),
			[]byte(fmt.Sprintf("%d (x) y) %s %d %d 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 %d 0", pid, state, p.ppid, pid, 500+pid)), 0o644))
		nspid := strconv.Itoa(pid)
		for i := 0; i < p.depth; i++ {
			nspid += "\t" + strconv.Itoa(i+2)
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, "status"), []byte("Name:\tx\nPPid:\t"+strconv.Itoa(p.ppid)+"\nNSpid:\t"+nspid+"\n"), 0o644))
		require.NoError(t, os.Symlink(fmt.Sprintf("pid:[%d]", 1+p.depth), filepath.Join(dir, "ns", "pid")))
	}
	require.NoError(t, os.Symlink(strconv.Itoa(fakeSelf), filepath.Join(root, "self")))
	return root
}

func markersEnv(sb, key, inst string) string {
	return provider.EnvDeployment + "=d\x00" + provider.EnvSandboxRoot + "=/r\x00" + provider.EnvSandbox + "=" + sb + "\x00" + provider.EnvRuntimeKey + "=" + key + "\x00" + provider.EnvInstance + "=" + inst + "\x00" + provider.EnvGeneration + "=1\x00"
}

// Discovery by anchor and tree (DESIGN.md 3.3 "Discovery no sandbox can
// blind"), over fake /proc trees: markers count only at the service's own
// depth, everything below an anchor is its unit's, and an unreadable
// process fails discovery only for the sandbox it concerns.
func TestDiscoveryByAnchorAndTree(t *testing.T) {
	ctx := context.Background()
	anchorA := markersEnv("sb", "k", "i")
	cases := map[string]struct {
		procs   map[int]fp
		records []nsRecord
		want    provider.DiscoverKind
		members int // processes inside the sandbox's namespaces, when present
	}{
		"live marked": {procs: map[int]fp{13: {ppid: 1, env: anchorA}}, want: provider.Present},
		"nested sandbox is the anchor's": {procs: map[int]fp{
			13: {ppid: 1, env: anchorA}, 20: {ppid: 13, depth: 1}, 21: {ppid: 20, depth: 1}, // bwrap init, the wrapper
			22: {ppid: 21, depth: 1}, 23: {ppid: 22, depth: 2}, 24: {ppid: 23, depth: 2}, // inner bwrap, its init, the agent
			25: {ppid: 24, depth: 2, env: unreadable}, // a non-dumpable process of the agent
		}, want: provider.Present, members: 6},
		"another sandbox's non-dumpable process": {procs: map[int]fp{
			13: {ppid: 1, env: anchorA}, 30: {ppid: 1, env: markersEnv("sb2", "k", "i")},
			31: {ppid: 30, depth: 1, env: unreadable}, 32: {ppid: 31, depth: 1, env: unreadable},
		}, want: provider.Present},
		"the service and other services are unreadable": {procs: map[int]fp{
			13: {ppid: 1, env: anchorA}, 40: {ppid: 1, env: unreadable},
		}, want: provider.Present},
		"unreadable recorded wrapper": {procs: map[int]fp{13: {ppid: 1, env: unreadable}, 20: {ppid: 13, depth: 1}},
			records: []nsRecord{{RuntimeKey: "k", AnchorPID: 13, AnchorStart: 513, InitPID: 20, InitStart: 520}},
			want:    provider.InspectionFailed},
		"unreadable child of the service": {procs: map[int]fp{13: {ppid: fakeSelf, env: unreadable}}, want: provider.InspectionFailed},
		"recorded wrapper, pid reused":    {procs: map[int]fp{13: {ppid: 1, env: unreadable}}, records: []nsRecord{{RuntimeKey: "k", AnchorPID: 13, AnchorStart: 1}}, want: provider.Absent},
		"markers inside a sandbox are not trusted": {procs: map[int]fp{
			30: {ppid: 1, env: markersEnv("sb2", "k", "i")}, 31: {ppid: 30, depth: 1, env: anchorA},
		}, want: provider.Absent},
		"orphaned namespace by its record": {procs: map[int]fp{
			20: {ppid: 1, depth: 1}, 21: {ppid: 20, depth: 1}, 22: {ppid: 21, depth: 2, env: unreadable},
		}, records: []nsRecord{{RuntimeKey: "k", Instance: "i", Generation: 1, AnchorPID: 13, AnchorStart: 513, InitPID: 20, InitStart: 520}},
			want: provider.Present, members: 3},
		"vanished process":  {procs: map[int]fp{11: {ppid: 1}}, want: provider.Absent},
		"zombie is gone":    {procs: map[int]fp{12: {ppid: 1, env: anchorA, state: "Z"}}, want: provider.Absent},
		"substring key":     {procs: map[int]fp{14: {ppid: 1, env: markersEnv("sb", "k2", "i")}, 15: {ppid: 1, env: markersEnv("sb2", "k", "i")}}, want: provider.Absent},
		"unreadable status": {procs: map[int]fp{13: {ppid: 1, env: anchorA}, 50: {ppid: 1, state: "<no status>"}}, want: provider.InspectionFailed},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			root := fakeProc(t, c.procs)
			for pid, p := range c.procs {
				if p.state == "<no status>" {
					status := filepath.Join(root, strconv.Itoa(pid), "status")
					require.NoError(t, os.Remove(status))
					require.NoError(t, os.Mkdir(status, 0o755))
				}
			}
			p, err := New(Config{Root: t.TempDir(), ProcRoot: root, Deployment: "d", Sleep: func(context.Context, time.Duration) error { return nil }})
			require.NoError(t, err)
			p.scope.root = "/r"
			for i, r := range c.records {
				require.NoError(t, os.MkdirAll(p.runDir("sb"), 0o700))
				b, err := json.Marshal(r)
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(filepath.Join(p.runDir("sb"), fmt.Sprintf("r%d.json", i)), b, 0o600))
			}
			d := p.Discover(ctx, "sb", "k")
			require.Equal(t, c.want, d.Kind, "%v", d.Err)
			switch c.want {
			case provider.InspectionFailed:
				require.Error(t, d.Err)
				require.Equal(t, provider.StopInspectionFailed, p.Stop(ctx, provider.StopTarget{SandboxID: "sb", RuntimeKey: "k"}).Kind)
				require.Equal(t, provider.InspectionFailed, p.DiscoverSandbox(ctx, "sb").Kind)
				_, err := p.LiveWorkspaces(ctx, "sb")
				require.Error(t, err)
			case provider.Present:
				require.Len(t, d.Observed, 1)
				require.Equal(t, "i", d.Observed[0].InstanceID)
				us, err := p.units("sb")
				require.NoError(t, err)
				require.Len(t, us[0].members, c.members)
			}
		})
	}
	t.Run("failed listing", func(t *testing.T) {
		p, err := New(Config{Root: t.TempDir(), ProcRoot: filepath.Join(t.TempDir(), "missing"), Deployment: "d"})
		require.NoError(t, err)
		require.Equal(t, provider.InspectionFailed, p.Discover(ctx, "sb", "k").Kind)
	})
}

func TestDeleteWorkspaceAndHome(t *testing.T) {
	p := newProvider(t)
	ctx := context.Background()
	for _, ws := range []string{"/a", "/b"} {
		warm, err := p.PrepareWorkspace(ctx, "sb", ws, ws)
		require.NoError(t, err)
		require.False(t, warm)
	}
	warm, err := p.PrepareWorkspace(ctx, "sb", "/a", "/a")
	require.NoError(t, err)
	require.True(t, warm)
	// A per-session runtime key of /b: its own home, gone with the key.
	_, err = p.PrepareWorkspace(ctx, "sb", "/b", "ses-1")
	require.NoError(t, err)
	require.DirExists(t, p.HomeDir("sb", "ses-1"))
	require.NoError(t, p.Delete(ctx, "sb", "ses-1", provider.DeleteHome))
	require.NoDirExists(t, p.HomeDir("sb", "ses-1"))
	require.DirExists(t, p.WorkspaceDir("sb", "/b"), "the workspace stays warm")
	require.DirExists(t, p.HomeDir("sb", "/b"))
	// What ran inside may have locked a directory of its checkout.
	locked := filepath.Join(p.WorkspaceDir("sb", "/a"), "locked")
	require.NoError(t, os.MkdirAll(filepath.Join(locked, "deep"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(locked, "deep", "f"), []byte("x"), 0o644))
	require.NoError(t, os.Chmod(locked, 0))
	logA := filepath.Join(p.SandboxDir("sb"), "logs", WorkspaceName("/a")+".inst-1.log")
	logB := filepath.Join(p.SandboxDir("sb"), "logs", WorkspaceName("/b")+".inst-2.log")
	require.NoError(t, os.WriteFile(logA, []byte("log"), 0o644))
	require.NoError(t, os.WriteFile(logB, []byte("log"), 0o644))
	require.NoError(t, p.Delete(ctx, "sb", "/a", provider.DeleteWorkspace))
	require.NoFileExists(t, logA, "the workspace's wrapper logs go with it")
	require.FileExists(t, logB)
	require.NoDirExists(t, p.WorkspaceDir("sb", "/a"))
	require.NoDirExists(t, p.HomeDir("sb", "/a"))
	require.DirExists(t, p.WorkspaceDir("sb", "/b"))
	require.Error(t, p.Create(ctx, "../x"))
	require.Error(t, p.RemoveWorkspace(ctx, "sb", ".."))
}

// StateKept: a resumed route needs both its workspace and its runtime
// key's home; either gone is loss, a bad sandbox id is an error.
func TestStateKept(t *testing.T) {
	p := newProvider(t)
	ctx := context.Background()
	_, err := p.PrepareWorkspace(ctx, "sb", "/a", "ses-1")
	require.NoError(t, err)
	kept, err := p.StateKept(ctx, "sb", "/a", "ses-1")
	require.NoError(t, err)
	require.True(t, kept)
	require.NoError(t, os.RemoveAll(p.HomeDir("sb", "ses-1")))
	kept, err = p.StateKept(ctx, "sb", "/a", "ses-1")
	require.NoError(t, err)
	require.False(t, kept, "the home is gone")
	_, err = p.PrepareWorkspace(ctx, "sb", "/a", "ses-1")
	require.NoError(t, err)
	require.NoError(t, os.RemoveAll(p.WorkspaceDir("sb", "/a")))
	kept, err = p.StateKept(ctx, "sb", "/a", "ses-1")
	require.NoError(t, err)
	require.False(t, kept, "the workspace is gone")
	_, err = p.StateKept(ctx, "../x", "/a", "ses-1")
	require.Error(t, err)
}

func TestWorkspaceName(t *testing.T) {
	require.NotEqual(t, WorkspaceName("/a/repo"), WorkspaceName("/b/repo"))
	require.True(t, strings.HasPrefix(WorkspaceName("/a/repo"), "repo-"))
	for _, s := range []string{"", "/", "..", "../..", ".hidden", "a/../../b", "x\x00y"} {
		n := WorkspaceName(s)
		require.Equal(t, filepath.Base(n), n)
		require.False(t, strings.HasPrefix(n, "."), n)
	}
}

func FuzzWorkspaceName(f *testing.F) {
	for _, s := range []string{"/home/u/repo", "..", "", "a/b/../c", "\xff\xfe"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n := WorkspaceName(s)
		if n == "" || n == "." || n == ".." || strings.ContainsAny(n, "/\\\x00") || strings.HasPrefix(n, ".") || len(n) > 80 {
			t.Fatalf("unsafe name %q for %q", n, s)
		}
	})
}

func FuzzParseEnviron(f *testing.F) {
	f.Add([]byte(markersEnv("sb", "k", "i")))
	f.Add([]byte("A=1\x00A=2\x00=x\x00noeq\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		for k := range parseEnviron(b) {
			if k == "" || strings.ContainsAny(k, "=\x00") {
				t.Fatalf("bad key %q", k)
			}
		}
	})
}

// nsOf is the PID namespace bubblewrap (pid) created: its child's.
func nsOf(t *testing.T, pid int) string {
	t.Helper()
	var ns string
	require.Eventually(t, func() bool {
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			st, err := readStat(filepath.Join("/proc", e.Name(), "stat"))
			if err == nil && st.ppid == pid {
				ns, err = os.Readlink(filepath.Join("/proc", e.Name(), "ns", "pid"))
				return err == nil
			}
		}
		return false
	}, 10*time.Second, 10*time.Millisecond)
	self, err := os.Readlink("/proc/self/ns/pid")
	require.NoError(t, err)
	require.NotEqual(t, self, ns, "the wrapper runs in its own PID namespace")
	return ns
}

// inNS lists the live host pids in a PID namespace: a scan of host /proc.
// Namespace inodes are reused once a namespace is gone (other sandboxes on
// this host may get ours), so after a stop the check is leftOf(snapshot).
func inNS(ns string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if l, err := os.Readlink(filepath.Join("/proc", e.Name(), "ns", "pid")); err == nil && l == ns && alive(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// snapshot names processes by pid and start time.
func snapshot(t *testing.T, pids []int) map[int]uint64 {
	t.Helper()
	m := map[int]uint64{}
	for _, pid := range pids {
		if st, err := readStat("/proc/" + strconv.Itoa(pid) + "/stat"); err == nil {
			m[pid] = st.start
		}
	}
	return m
}

// leftOf lists the processes of a snapshot still alive (same pid, same
// start time, not a zombie).
func leftOf(snap map[int]uint64) []int {
	var left []int
	for pid, start := range snap {
		if st, err := readStat("/proc/" + strconv.Itoa(pid) + "/stat"); err == nil && st.start == start && st.state != 'Z' && st.state != 'X' {
			left = append(left, pid)
		}
	}
	return left
}

func TestStopEndsEveryDescendant(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	o := launch(t, p, sb, "k", "i", "leak", "/w")
	ns := nsOf(t, o.PID)
	require.Eventually(t, func() bool { return len(inNS(ns)) >= 6 }, 10*time.Second, 10*time.Millisecond,
		"init, the helper and four sleeps")
	d := p.Discover(context.Background(), sb, "k")
	require.Equal(t, provider.Present, d.Kind)
	require.Len(t, d.Observed, 1, "one wrapper, however many processes it has")
	require.Equal(t, o.PID, d.Observed[0].PID)

	snap := snapshot(t, inNS(ns))
	res := p.Stop(context.Background(), provider.StopTarget{SandboxID: sb, RuntimeKey: "k"})
	require.Equal(t, provider.StopAbsent, res.Kind, "%v", res.Err)
	require.Empty(t, leftOf(snap), "absence is verified only when no process of the key remains")
	p.Wait()
}

func TestKilledWrapperTakesItsNamespace(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	o := launch(t, p, sb, "k", "i", "leak", "/w")
	ns := nsOf(t, o.PID)
	require.Eventually(t, func() bool { return len(inNS(ns)) >= 6 }, 10*time.Second, 10*time.Millisecond)
	// kill -9 of the wrapper itself (the init's child), not of bubblewrap.
	var wrapperPID int
	for _, pid := range inNS(ns) {
		st, err := readStat("/proc/" + strconv.Itoa(pid) + "/stat")
		require.NoError(t, err)
		if parent, err := os.Readlink("/proc/" + strconv.Itoa(st.ppid) + "/ns/pid"); err == nil && parent != ns {
			continue // the init
		}
		if cmd, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); strings.HasPrefix(string(cmd), os.Args[0]) {
			wrapperPID = pid
		}
	}
	require.NotZero(t, wrapperPID)
	snap := snapshot(t, inNS(ns))
	require.NoError(t, syscall.Kill(wrapperPID, syscall.SIGKILL))
	eventuallyAbsent(t, p, sb, snap)
	p.Wait()
}

// eventuallyAbsent polls discovery until it reports absent, checking each
// time that absent is never said while a process of the namespace remains.
func eventuallyAbsent(t *testing.T, p *Provider, sb string, snap map[int]uint64) {
	t.Helper()
	var early []int
	require.Eventually(t, func() bool {
		if p.Discover(context.Background(), sb, "k").Kind != provider.Absent {
			return false
		}
		early = leftOf(snap)
		return true
	}, 20*time.Second, time.Millisecond)
	require.Empty(t, early, "discovery said absent while processes of the key remained")
}

// Two deployments on one host with the same sandbox id and runtime key
// (same org and user) never see or stop each other's wrappers.
func TestDeploymentsDoNotTouchEachOther(t *testing.T) {
	iso := isolation(t)
	p1, err := New(Config{Root: t.TempDir(), Isolation: iso})
	require.NoError(t, err)
	p2, err := New(Config{Root: t.TempDir(), Isolation: iso})
	require.NoError(t, err)
	require.NotEqual(t, p1.cfg.Deployment, p2.cfg.Deployment)
	sb := sandboxID(t, p1)
	_ = sandboxID(t, p2)
	o1 := launch(t, p1, sb, "k", "i", "sleep", "/w")
	o2 := launch(t, p2, sb, "k", "i", "sleep", "/w")
	d := p1.Discover(context.Background(), sb, "k")
	require.Equal(t, provider.Present, d.Kind)
	require.Len(t, d.Observed, 1)
	require.Equal(t, o1.PID, d.Observed[0].PID)
	require.Equal(t, provider.StopAbsent, p1.Stop(context.Background(), provider.StopTarget{SandboxID: sb, RuntimeKey: "k"}).Kind)
	require.False(t, alive(o1.PID))
	require.True(t, alive(o2.PID), "the other deployment's wrapper is untouched")
	require.Equal(t, provider.Present, p2.Discover(context.Background(), sb, "k").Kind)
	require.Equal(t, provider.StopAbsent, p2.Stop(context.Background(), provider.StopTarget{SandboxID: sb, RuntimeKey: "k"}).Kind)
	p1.Wait()
	p2.Wait()
}

// kill -9 of a wrapper's bubblewrap (the anchor) ends its namespace, and
// discovery never says absent before the last process is gone.
func TestKilledBubblewrapLeavesNothingBehind(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	o := launch(t, p, sb, "k", "i", "leak", "/w")
	ns := nsOf(t, o.PID)
	require.Eventually(t, func() bool { return len(inNS(ns)) >= 6 }, 10*time.Second, 10*time.Millisecond)
	snap := snapshot(t, append(inNS(ns), o.PID))
	require.NoError(t, syscall.Kill(o.PID, syscall.SIGKILL))
	eventuallyAbsent(t, p, sb, snap)
	p.Wait()
}

// A namespace whose bubblewrap is gone while its init still runs (the
// service that launched it died too, so nobody ended the init) is found by
// its record and stopped like any wrapper.
func TestOrphanedNamespaceIsFoundByItsRecord(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	o := launch(t, p, sb, "k", "i", "leak", "/w")
	ns := nsOf(t, o.PID)
	require.Eventually(t, func() bool { return len(inNS(ns)) >= 6 }, 10*time.Second, 10*time.Millisecond)
	recs, err := p.records(sb)
	require.NoError(t, err)
	require.Len(t, recs, 1)
	// What a dead service leaves: the records, and the namespace without
	// its bubblewrap. Read through a second provider (a new incarnation).
	p2, err := New(Config{Root: p.cfg.Root, Isolation: p.cfg.Isolation})
	require.NoError(t, err)
	table, err := scanAll("/proc")
	require.NoError(t, err)
	delete(table.procs, o.PID) // as if bubblewrap were gone
	us, err := units(table, p2.scope, sb, recs)
	require.NoError(t, err)
	require.Len(t, us, 1)
	require.True(t, us[0].orphan)
	require.Equal(t, "i", observed(us[0]).InstanceID)
	require.Len(t, us[0].members, len(inNS(ns)))
	snap := snapshot(t, inNS(ns))
	require.Equal(t, provider.StopAbsent, p2.Stop(context.Background(), provider.StopTarget{SandboxID: sb, RuntimeKey: "k"}).Kind)
	require.Empty(t, leftOf(snap))
	p.Wait()
}

// TestWrapperWorksAtTheRoutesDirectory: behind the boundary the wrapper's
// working directory is the route's directory, where its workspace is
// bound (what it writes there lands in the host's workspace), and its HOME
// is boundary.InnerHome; a directory the sandbox binds itself (a system
// path, the home's path, the wrapper binary and above it) is refused before
// anything is made or started (issue 32 item 5).
func TestWrapperWorksAtTheRoutesDirectory(t *testing.T) {
	p := newProvider(t)
	sb := sandboxID(t, p)
	launch(t, p, sb, "k", "i1", "cwd", "/home/u/repo")
	b, err := os.ReadFile(filepath.Join(p.WorkspaceDir(sb, "/home/u/repo"), "cwd"))
	require.NoError(t, err)
	require.Equal(t, "/home/u/repo "+boundary.InnerHome, string(b), "the wrapper works at the route's directory, its HOME at the home's own path")

	for _, dir := range []string{"/proc/x", "/tmp", boundary.InnerHome, os.Args[0], filepath.Dir(os.Args[0])} {
		_, err = p.Launch(context.Background(), provider.LaunchSpec{
			Markers: provider.Markers{SandboxID: sb, RuntimeKey: "k2", InstanceID: "i2", Generation: 1},
			Path:    os.Args[0], Env: []string{"HELPER_MODE=sleep"}, Workspace: dir,
		})
		require.ErrorIs(t, err, provider.ErrDirectoryReserved, dir)
		require.NoDirExists(t, p.WorkspaceDir(sb, dir), "nothing made for %s", dir)
	}
	require.Equal(t, provider.Absent, p.Discover(context.Background(), sb, "k2").Kind)
}
