package boundary

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// reachableCopy copies the test binary where another uid can run it (go
// test builds into a directory only its user can enter).
func reachableCopy(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "nested-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	self, err := os.Executable()
	require.NoError(t, err)
	src, err := os.Open(self)
	require.NoError(t, err)
	defer src.Close()
	bin := filepath.Join(dir, "boundary.test")
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(dst, src)
	require.NoError(t, err)
	require.NoError(t, dst.Close())
	return bin
}

// TestNestedSandbox runs the helper as the agent runs: in the nested
// sandbox (NestedArgs, the strict filter) inside a wrapper's sandbox with
// the supervisor's filter, as the sandbox service builds them. The agent is
// pid 2 of its own namespace and sees only its init; every refused call is
// EPERM again (the filters stack); the host's socket directory is not in
// its view; it runs with no capabilities and two filters.
func TestNestedSandbox(t *testing.T) {
	bw := bwrapOrFail(t)
	c := Config{Bwrap: bw, UID: -1, GID: -1, Nested: true}
	self, err := os.Executable()
	require.NoError(t, err)
	if os.Geteuid() == 0 {
		// A sandbox that maps host root cannot hold the nested one (the
		// probe says why); the service runs them as another uid.
		err := c.Probe(context.Background(), "", "")
		require.ErrorContains(t, err, "SANDBOX_UID")
		c.UID, c.GID = 65534, 65534
		self = reachableCopy(t)
	}
	sockets, err := os.MkdirTemp("", "sockets-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(sockets) })
	require.NoError(t, os.Chmod(sockets, 0o755))
	c.SocketDir = sockets
	require.NoError(t, c.Probe(context.Background(), "", self))
	dir, err := os.MkdirTemp("", "ws-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o777))

	files, err := c.OpenFiles()
	require.NoError(t, err)
	defer files.Close()
	inner, err := SeccompFile()
	require.NoError(t, err)
	defer inner.Close()
	extra := append(files.List(), inner)
	home, err := os.MkdirTemp("", "home-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(home) })
	require.NoError(t, os.Chmod(home, 0o777))
	m := Mount{Workspace: dir, At: sessionDirectory, Home: home, Program: self}
	args := append(c.Args(m, files, 3), bw)
	args = append(append(args, NestedArgs(3+len(extra)-1, sessionDirectory)...), self)
	cmd := exec.Command(bw, args...)
	cmd.Env = []string{"BOUNDARY_HELPER=1", "WORKSPACE_HOST=" + dir, "HOME_HOST=" + home}
	cmd.ExtraFiles = extra
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.Credential()}
	out, err := cmd.Output()
	require.NoError(t, err, "%s", exitStderr(err))
	got := map[string]string{}
	require.NoError(t, json.Unmarshal(out, &got), "%s", out)
	for _, k := range []string{"ptrace", "unshare_user", "unshare_ns", "mount", "keyctl", "bpf", "perf_event_open", "kexec_load", "clone_newuser", "raise_nofile"} {
		require.Equal(t, "EPERM", got[k], "%s: %v", k, got)
	}
	require.Equal(t, "0000000000000000", got["CapEff"])
	require.Equal(t, "2", got["pid"], "own PID namespace: its bubblewrap's init is 1")
	require.Equal(t, "2", got["visible_pids"], "only its init and itself: not the wrapper")
	require.Equal(t, "ENOENT", got["stat_sockets"], "the host's socket directory is out of the agent's view")
	require.Equal(t, "2", got["Seccomp_filters"], "the wrapper's filter and its own")
	require.Equal(t, "ok", got["create_in_tmp"])
	require.Equal(t, sessionDirectory, got["cwd"], "the agent works at the session's directory")
	require.Equal(t, "ok", got["write_in_cwd"])
	require.FileExists(t, filepath.Join(dir, "hello.txt"), "in the host's workspace")
	require.Equal(t, "ENOENT", got["stat_host_workspace"])
	require.Equal(t, InnerHome, got["home"])
	require.Equal(t, "ok", got["write_in_home"])
	require.FileExists(t, filepath.Join(home, "state"), "in the host's home")
	require.Equal(t, "ENOENT", got["stat_host_home"])
}
