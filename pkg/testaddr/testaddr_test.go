package testaddr

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPortsAreDistinctFreeAndOutsideTheEphemeralRange(t *testing.T) {
	t.Parallel()
	seen := map[int]bool{}
	for range 50 {
		p := Port(t)
		require.False(t, seen[p], "port %d handed out twice", p)
		seen[p] = true
		require.True(t, p >= low && p < high)
	}
	l, err := net.Listen("tcp", Addr(t))
	require.NoError(t, err, "a reserved port can be listened on")
	require.NoError(t, l.Close())
}

// A reservation is held against another process until released.
func TestReservationHoldsAcrossProcesses(t *testing.T) {
	t.Parallel()
	port, release, err := Reserve()
	require.NoError(t, err)
	lock := filepath.Join(os.TempDir(), "agentplane-test-ports", strconv.Itoa(port))
	// flock(1) in another process tries the lock as another test binary would.
	err = exec.Command("flock", "-n", "-E", "75", lock, "true").Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	require.Equal(t, 75, exit.ExitCode(), "another process cannot take a held port")
	release()
	require.NoError(t, exec.Command("flock", "-n", lock, "true").Run(), "a released port can be taken")
}
