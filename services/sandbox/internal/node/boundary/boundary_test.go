package boundary

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"agentplane.dev/pkg/testenv"
)

// The test binary doubles as the program run inside the boundary: with
// BOUNDARY_HELPER set it tries what a hostile runtime would and prints the
// errno of each attempt as JSON.
func TestMain(m *testing.M) {
	if os.Getenv("BOUNDARY_HELPER") != "" {
		os.Exit(helper())
	}
	if l := os.Getenv("LIMITS_HELPER"); l != "" {
		os.Exit(limitsHelper(l))
	}
	os.Exit(m.Run())
}

func errno(err error) string {
	if err == nil {
		return "ok"
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		return unix.ErrnoName(e)
	}
	return err.Error()
}

func helper() int {
	got := map[string]string{}
	_, _, e := unix.RawSyscall(unix.SYS_PTRACE, unix.PTRACE_TRACEME, 0, 0)
	got["ptrace"] = errno(errOrNil(e))
	got["unshare_user"] = errno(unix.Unshare(unix.CLONE_NEWUSER))
	got["unshare_ns"] = errno(unix.Unshare(unix.CLONE_NEWNS))
	got["mount"] = errno(unix.Mount("tmpfs", "/tmp", "tmpfs", 0, ""))
	_, _, e = unix.RawSyscall(unix.SYS_KEYCTL, 0 /* KEYCTL_GET_KEYRING_ID */, 0, 0)
	got["keyctl"] = errno(errOrNil(e))
	_, _, e = unix.RawSyscall(unix.SYS_BPF, 0, 0, 0)
	got["bpf"] = errno(errOrNil(e))
	_, _, e = unix.RawSyscall6(unix.SYS_PERF_EVENT_OPEN, 0, 0, ^uintptr(0), ^uintptr(0), 0, 0)
	got["perf_event_open"] = errno(errOrNil(e))
	_, _, e = unix.RawSyscall6(unix.SYS_KEXEC_LOAD, 0, 0, 0, 0, 0, 0)
	got["kexec_load"] = errno(errOrNil(e))
	_, _, e = unix.RawSyscall(unix.SYS_CLONE, unix.CLONE_NEWUSER|uintptr(syscall.SIGCHLD), 0, 0)
	got["clone_newuser"] = errno(errOrNil(e))
	_, _, e = unix.RawSyscall(unix.SYS_CLONE3, 0, 0, 0)
	got["clone3"] = errno(errOrNil(e))
	if err := (Limits{OpenFiles: 64, Processes: 100, AddressSpace: 0}).Apply(); err != nil {
		got["apply"] = err.Error()
	}
	got["raise_nofile"] = errno(syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: 65, Max: 65}))
	status, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(status), "\n") {
		for _, k := range []string{"CapEff", "CapPrm", "NoNewPrivs", "Seccomp", "Seccomp_filters"} {
			if v, ok := strings.CutPrefix(line, k+":"); ok {
				got[k] = strings.TrimSpace(v)
			}
		}
	}
	got["pid"] = fmt.Sprint(os.Getpid())
	ents, _ := os.ReadDir("/proc")
	n := 0
	for _, e := range ents {
		if e.Name()[0] >= '0' && e.Name()[0] <= '9' {
			n++
		}
	}
	got["visible_pids"] = fmt.Sprint(n)
	_, err := os.Stat("/work")
	got["stat_host_dir"] = errno(err)
	_, err = os.Stat(InnerSocketDir)
	got["stat_sockets"] = errno(err)
	passwd, _ := os.ReadFile("/etc/passwd")
	got["read_passwd"] = string(passwd)
	if f, err := os.OpenFile("/etc/passwd", os.O_WRONLY|os.O_APPEND, 0); err != nil {
		got["write_passwd"] = errno(err)
	} else {
		_ = f.Close()
		got["write_passwd"] = "ok"
	}
	got["cwd"], _ = os.Getwd()
	got["write_in_cwd"] = errno(os.WriteFile("hello.txt", []byte("hi"), 0o644))
	_, err = os.Stat(os.Getenv("WORKSPACE_HOST"))
	got["stat_host_workspace"] = errno(err)
	got["home"] = os.Getenv("HOME")
	got["write_in_home"] = errno(os.WriteFile(filepath.Join(os.Getenv("HOME"), "state"), []byte("s"), 0o600))
	_, err = os.Stat(os.Getenv("HOME_HOST"))
	got["stat_host_home"] = errno(err)
	got["create_in_root"] = errno(os.WriteFile("/hostile", nil, 0o644))
	got["create_in_tmp"] = errno(os.WriteFile("/tmp/ok", nil, 0o644))
	fds, _ := os.ReadDir("/proc/self/fd")
	got["etc_fds"] = ""
	for _, fd := range fds {
		if target, err := os.Readlink("/proc/self/fd/" + fd.Name()); err == nil && strings.HasPrefix(target, "/etc") {
			got["etc_fds"] += fd.Name() + "→" + target + " "
		}
	}
	_ = json.NewEncoder(os.Stdout).Encode(got)
	return 0
}

func errOrNil(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func bwrapOrFail(t *testing.T) string {
	t.Helper()
	p, err := FindBwrap(os.Getenv("AGENTPLANE_SANDBOX_BWRAP"))
	if err != nil {
		testenv.Missing(t, "bubblewrap: %v", err)
	}
	return p
}

// runSelfInSandbox runs this test binary, with helper=1 in its
// environment, under the real bubblewrap command line and seccomp filter,
// and decodes the JSON object of probe results it prints.
func runSelfInSandbox(t *testing.T, helper string) map[string]string {
	t.Helper()
	got, _ := runSelfInSandboxWith(t, helper)
	return got
}

// runSelfInSandboxAt is runSelfInSandbox with the boundary helper; it also
// returns the host's workspace directory.
func runSelfInSandboxAt(t *testing.T) (map[string]string, string) {
	t.Helper()
	return runSelfInSandboxWith(t, "BOUNDARY_HELPER")
}

func runSelfInSandboxWith(t *testing.T, helper string) (map[string]string, string) {
	t.Helper()
	bw := bwrapOrFail(t)
	self, err := os.Executable()
	require.NoError(t, err)
	dir := t.TempDir()
	c := Config{Bwrap: bw, UID: -1, GID: -1}
	require.NoError(t, c.Probe(context.Background(), "", ""))
	files, err := c.OpenFiles()
	require.NoError(t, err)
	defer files.Close()
	home := t.TempDir()
	m := Mount{Workspace: dir, At: sessionDirectory, Home: home, Program: self}
	require.NoError(t, c.Check(m))
	args := append(c.Args(m, files, 3), self)
	cmd := exec.Command(bw, args...)
	cmd.Env = []string{helper + "=1", "WORKSPACE_HOST=" + dir, "HOME_HOST=" + home, "HOME=" + home}
	cmd.ExtraFiles = files.List()
	out, err := cmd.Output()
	require.NoError(t, err, "%s", exitStderr(err))
	got := map[string]string{}
	require.NoError(t, json.Unmarshal(out, &got), "%s", out)
	return got, dir
}

// TestBoundaryRefusesWhatReachesOut runs a real program under the real
// bubblewrap command line and seccomp filter.
func TestBoundaryRefusesWhatReachesOut(t *testing.T) {
	got := runSelfInSandbox(t, "BOUNDARY_HELPER")
	for _, k := range []string{"ptrace", "unshare_user", "unshare_ns", "mount", "keyctl", "bpf", "perf_event_open", "kexec_load", "clone_newuser", "raise_nofile"} {
		require.Equal(t, "EPERM", got[k], "%s: %v", k, got)
	}
	require.Equal(t, "ENOSYS", got["clone3"], "clone3 falls back to clone: %v", got)
	require.Empty(t, got["apply"])
	require.Equal(t, "0000000000000000", got["CapEff"])
	require.Equal(t, "0000000000000000", got["CapPrm"])
	require.Equal(t, "1", got["NoNewPrivs"])
	require.Equal(t, "2", got["Seccomp"], "filter mode")
	require.Equal(t, "2", got["pid"], "own PID namespace: bubblewrap's init is 1")
	require.Equal(t, "2", got["visible_pids"], "only the namespace's init and itself")
	require.Equal(t, "ENOENT", got["stat_host_dir"], "host directories outside the view do not exist")
	hostPasswd, err := os.ReadFile("/etc/passwd")
	require.NoError(t, err)
	require.Equal(t, string(hostPasswd), got["read_passwd"], "/etc/passwd is the host's (copied in)")
	require.Equal(t, "EROFS", got["write_passwd"], "the copied /etc files are read-only")
	require.Equal(t, "EROFS", got["create_in_root"], "the sandbox's root is read-only")
	require.Equal(t, "ok", got["create_in_tmp"], "its /tmp is writable")
	require.Empty(t, got["etc_fds"], "bubblewrap closed the descriptors it copied from")
}

// sessionDirectory is a session's directory: where the tests bind the
// workspace inside the sandbox.
const sessionDirectory = "/home/u/repo"

// TestWorkspaceIsAtTheSessionsDirectory: inside the sandbox the workspace
// is at the session's directory, which is the working directory; a file
// written there lands in the host's workspace, and the host's path of the
// workspace does not exist inside (issue 32 item 5).
func TestWorkspaceIsAtTheSessionsDirectory(t *testing.T) {
	got, dir := runSelfInSandboxAt(t)
	require.Equal(t, sessionDirectory, got["cwd"], "the working directory is the session's directory: %v", got)
	require.Equal(t, "ok", got["write_in_cwd"])
	b, err := os.ReadFile(filepath.Join(dir, "hello.txt"))
	require.NoError(t, err, "the file landed in the host's workspace")
	require.Equal(t, "hi", string(b))
	require.Equal(t, "ENOENT", got["stat_host_workspace"], "the host's layout is not in the sandbox")
	require.Equal(t, InnerHome, got["home"], "HOME is the home's own path inside, whatever the host's HOME")
	require.Equal(t, "ok", got["write_in_home"])
	require.Equal(t, "ENOENT", got["stat_host_home"], "the home's host path is not in the sandbox")
}

func TestCheckRefusesADirectoryTheSandboxBinds(t *testing.T) {
	c := Config{Bwrap: "/opt/bw/bwrap", ReadOnly: []string{"/opt/agents"}, Nested: true, UID: -1, GID: -1}
	m := Mount{Workspace: "/r/sb/workspaces/w", Home: "/r/sb/homes/w", Program: "/opt/bin/wrapper"}
	for _, ok := range []string{"/home/u/repo", "/work/e2e", "/tmp/repo", "/opt/agentsx", "/r/sb/workspaces/other", "/srv",
		"/r/sb/homes/w", "/r"} { // the home is bound at InnerHome, not at its host path
		m.At = ok
		require.NoError(t, c.Check(m), ok)
	}
	for _, bad := range []string{"/proc", "/usr/src", "/etc", "/tmp", "/run/agentplane", "/dev/x",
		InnerHome, InnerHome + "/x", "/agentplane", "/opt/agents", "/opt/agents/x", "/opt", "/opt/bin/wrapper", "/opt/bw"} {
		m.At = bad
		require.Error(t, c.Check(m), bad)
	}
	m.At = ""
	require.NoError(t, c.Check(m), "without At the workspace is at its own path")

	// The pinned agents are bound at InnerAgents, not at their host path: a directory
	// above or at them is the user's to name (`agentplane dev` run in the repository,
	// whose agents/ holds them), and InnerAgents is reserved.
	c.Agents = "/work/repo/agents"
	for _, ok := range []string{"/work/repo", "/work/repo/agents", "/work"} {
		m.At = ok
		require.NoError(t, c.Check(m), ok)
	}
	m.At = InnerAgents
	require.Error(t, c.Check(m))
	a := c.Args(m, &Files{}, 3)
	i := slices.Index(a, c.Agents)
	require.Positive(t, i, "the agents are bound: %v", a)
	require.Equal(t, []string{"--ro-bind", c.Agents, InnerAgents}, a[i-1:i+2])
}

func exitStderr(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(ee.Stderr)
	}
	return ""
}

func TestSeccompProgramShape(t *testing.T) {
	p, err := SeccompProgram()
	require.NoError(t, err)
	require.Zero(t, len(p)%8, "struct sock_filter is 8 bytes")
	require.Less(t, len(p)/8, 4096, "BPF_MAXINSNS")
}

func TestLimitsRoundTrip(t *testing.T) {
	l := Limits{OpenFiles: 10, Processes: 20, AddressSpace: 30, FileSize: 40, CPUSeconds: 50}
	got, err := ParseLimits(l.String())
	require.NoError(t, err)
	require.Equal(t, l, got)
	for _, bad := range []string{"nofile", "nofile=0", "nofile=-1", "x=1", "nofile=1,,", "as=1e9"} {
		_, err := ParseLimits(bad)
		require.Error(t, err, bad)
	}
	got, err = ParseLimits("")
	require.NoError(t, err)
	require.Equal(t, Limits{}, got)
}

func FuzzParseLimits(f *testing.F) {
	for _, s := range []string{"nofile=1,nproc=2,as=3", "", "as=", "=1", "nofile=18446744073709551615"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		l, err := ParseLimits(s)
		if err != nil {
			return
		}
		back, err := ParseLimits(l.String())
		if err != nil || back != l {
			t.Fatalf("%q → %+v → %q → %+v, %v", s, l, l.String(), back, err)
		}
	})
}

func TestArgsBindNothingElse(t *testing.T) {
	c := Config{Bwrap: "/usr/bin/bwrap", ReadOnly: []string{"/opt/agents"}, SocketDir: "/srv/sk", UID: -1, GID: -1}
	files, err := c.OpenFiles()
	require.NoError(t, err)
	defer files.Close()
	a := strings.Join(c.Args(Mount{Workspace: "/r/sb/workspaces/w", At: "/home/u/repo", Home: "/r/sb/homes/w", Program: "/bin/wrapper"}, files, 4), " ")
	require.Contains(t, a, "--bind /r/sb/workspaces/w /home/u/repo", "the workspace at the session's directory")
	require.Contains(t, a, "--bind /r/sb/homes/w "+InnerHome, "the home at its own path inside")
	require.Contains(t, a, "--ro-bind /opt/agents /opt/agents")
	require.Contains(t, a, "--ro-bind /srv/sk "+InnerSocketDir)
	require.Contains(t, a, "--seccomp 4")
	require.Contains(t, a, "--file 5 /etc/ld.so.cache", "regular /etc files are copied in from the next descriptors")
	require.Contains(t, a, "--ro-bind-try /etc/ssl/certs /etc/ssl/certs", "directories stay bound")
	require.True(t, strings.HasSuffix(a, "--remount-ro / --setenv TMPDIR /tmp --setenv HOME "+InnerHome+" --chdir /home/u/repo --"), "the root goes read-only last, the session's directory is the working directory")
	require.NotContains(t, a, "/r/sb/workspaces/w /r/sb/workspaces/w", "the host's workspace path is not bound")
	require.NotContains(t, a, "--bind / ")
	require.NotContains(t, a, "/r/sb ")
	require.Less(t, strings.Index(a, "--tmpfs /tmp"), strings.Index(a, "--bind /r/sb/homes"), "tmpfs before binds that may live under /tmp")
}
