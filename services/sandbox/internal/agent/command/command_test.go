package command

import (
	"context"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTailKeepsTheLastBytes(t *testing.T) {
	tail := &Tail{Max: 8}
	for _, s := range []string{"abc", "defgh", "ij", "0123456789", "x"} {
		n, err := tail.Write([]byte(s))
		require.NoError(t, err)
		require.Equal(t, len(s), n)
	}
	require.Equal(t, "3456789x", tail.String())
	tail = &Tail{Max: 4}
	_, _ = tail.Write([]byte("ab"))
	_, _ = tail.Write([]byte("cde"))
	require.Equal(t, "bcde", tail.String())
}

// The child's environment is exactly the one given: the parent's never
// leaks in, an empty one included.
func TestEnvIsExactlyTheGivenOne(t *testing.T) {
	t.Setenv("COMMAND_TEST_PARENT", "leaked")
	out, err := New(context.Background(), Spec{Path: "/usr/bin/env"}).Output()
	require.NoError(t, err)
	require.Empty(t, strings.TrimSpace(string(out)))
	out, err = New(context.Background(), Spec{Path: "/usr/bin/env", Env: []string{"A=1"}}).Output()
	require.NoError(t, err)
	require.Equal(t, "A=1\n", string(out))
}

// A flood on stderr is kept as its bounded tail.
func TestStderrIsABoundedTail(t *testing.T) {
	cmd := New(context.Background(), Spec{Path: "/bin/sh", Args: []string{"-c", "head -c 1000000 /dev/zero | tr '\\0' a >&2; echo end >&2; exit 3"},
		Env: []string{"PATH=/usr/bin:/bin"}})
	err := cmd.Run()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, 3, ee.ExitCode())
	got := Stderr(cmd)
	require.Len(t, got, StderrTail)
	require.True(t, strings.HasSuffix(got, "aaaend\n"))
}

// Without Outlives the child dies with its parent (Pdeathsig); with it, it
// does not; and Wait does not wait for a grandchild that holds the output.
func TestDeathSignalAndWaitDelay(t *testing.T) {
	require.NotNil(t, New(context.Background(), Spec{Path: "/bin/true"}).SysProcAttr)
	require.NotZero(t, New(context.Background(), Spec{Path: "/bin/true"}).SysProcAttr.Pdeathsig)
	require.Zero(t, New(context.Background(), Spec{Path: "/bin/true", Outlives: true}).SysProcAttr.Pdeathsig)
	require.True(t, New(context.Background(), Spec{Path: "/bin/true", Group: true}).SysProcAttr.Setpgid)

	// The grandchild keeps stdout open for a minute; Output returns once
	// WaitDelay has passed after the child exited.
	cmd := New(context.Background(), Spec{Path: "/bin/sh", Args: []string{"-c", "sleep 60 & echo started"},
		Env: []string{"PATH=/usr/bin:/bin"}, Group: true})
	out, err := cmd.Output()
	require.ErrorIs(t, err, exec.ErrWaitDelay)
	require.Equal(t, "started\n", string(out))
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
}
