//go:build linux

package nodump_test

import (
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/nodump"
)

// TestSet: a process is dumpable until Set, and the kernel then hands its ptrace-guarded
// /proc files to root. (cmd/agentplane's TestSecretsOutOfReach shows another process of the
// same uid is refused the environment and memory of a running service.)
func TestSet(t *testing.T) {
	d, err := nodump.Dumpable()
	require.NoError(t, err)
	require.True(t, d, "a fresh test process is dumpable")
	require.NoError(t, nodump.Set())
	d, err = nodump.Dumpable()
	require.NoError(t, err)
	require.False(t, d)
	if os.Geteuid() != 0 {
		fi, err := os.Stat("/proc/self/environ")
		require.NoError(t, err)
		require.Equal(t, uint32(0), fi.Sys().(*syscall.Stat_t).Uid, "environ now belongs to root")
	}
}
