package socketrelay

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// flood (the test binary as a sandbox's process) opens RELAY_FLOOD_N
// connections to path, says how many it holds, and holds them until its
// stdin closes.
func flood(path string) int {
	n, _ := strconv.Atoi(os.Getenv("RELAY_FLOOD_N"))
	var held []net.Conn
	for range n {
		c, err := net.Dial("unix", path)
		if err != nil {
			continue
		}
		held = append(held, c)
	}
	fmt.Println(len(held))
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// startFlood runs flood against path, in a PID namespace of its own when
// own is set (as each sandbox is), and returns once it holds its
// connections; closing the returned writer ends it.
func startFlood(t *testing.T, path string, n int, own bool) io.WriteCloser {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(self)
	cmd.Env = []string{"RELAY_FLOOD=" + path, "RELAY_FLOOD_N=" + strconv.Itoa(n)}
	if own {
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_NEWPID,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}}}
	}
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = in.Close(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	require.NotEmpty(t, line)
	return in
}

// TestBoundHoldsAFloodToItsPeer (issue 31: 5 × 4,000 connections to the
// control socket held 20,000 of the service's descriptors): one peer's
// 2,000 connections cost the service at most PerPeer descriptors, and
// another peer still connects meanwhile.
func TestBoundHoldsAFloodToItsPeer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	raw, err := Listen(path)
	require.NoError(t, err)
	ln := Bound(raw, Bounds{PerPeer: 8, Idle: time.Minute})
	served := make(chan struct{})
	go func() {
		defer close(served)
		Accept(ln, func(c net.Conn) {
			_, _ = io.WriteString(c, "hi\n")
			_, _ = io.Copy(io.Discard, c)
		})
	}()
	defer func() { _ = ln.Close(); <-served }()

	before := openFDs(t)
	a := startFlood(t, path, 2000, true)
	// Every refused connection was accepted and closed: once the second
	// peer is served, the first one's flood has been through Accept.
	b, err := net.Dial("unix", path) // this process: another PID namespace than the flood's
	require.NoError(t, err)
	defer b.Close()
	_ = b.SetReadDeadline(time.Now().Add(time.Minute))
	line, err := bufio.NewReader(b).ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "hi\n", line, "another peer is served while the first holds its bound")
	grew := openFDs(t) - before
	require.LessOrEqual(t, grew, 8+2+4, "the service holds the flood's bound (8), the other peer's two ends and a few of its own")
	_ = a.Close()
}

// TestBoundClosesAnIdleConnection: a connection that sends nothing for
// Idle is closed by the service.
func TestBoundClosesAnIdleConnection(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	raw, err := Listen(path)
	require.NoError(t, err)
	ln := Bound(raw, Bounds{PerPeer: 8, Idle: 100 * time.Millisecond})
	served := make(chan struct{})
	go func() {
		defer close(served)
		Accept(ln, func(c net.Conn) { defer c.Close(); _, _ = io.Copy(io.Discard, c) })
	}()
	defer func() { _ = ln.Close(); <-served }()
	c, err := net.Dial("unix", path)
	require.NoError(t, err)
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "the service closed the idle connection")
}
