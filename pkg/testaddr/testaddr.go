// Package testaddr hands tests loopback ports for servers that another
// process will listen on (a service binary, redis-server), without the race
// of "listen on :0, close, hand the port on": in that gap the kernel may give
// the port to anyone asking for :0 or for a connection's source port, and a
// test process beside this one may pick it the same way.
//
// Ports come from below Linux's default ephemeral range (32768–60999), which
// the kernel never hands out by itself, and each is reserved across processes
// by an exclusive lock on a file named after it, held until the reservation
// is released: two test processes on one machine never get the same port.
package testaddr

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
)

// The ports handed out: [low, high).
const low, high = 20000, 32768

// Addr is "127.0.0.1:port" of a port free now and reserved until tb ends.
func Addr(tb testing.TB) string {
	tb.Helper()
	return "127.0.0.1:" + strconv.Itoa(Port(tb))
}

// Port is a port free now and reserved until tb ends.
func Port(tb testing.TB) int {
	tb.Helper()
	port, release, err := Reserve()
	if err != nil {
		tb.Fatalf("testaddr: %v", err)
	}
	tb.Cleanup(release)
	return port
}

// Reserve returns a port free now, reserved until release is called.
func Reserve() (port int, release func(), err error) {
	start := rand.IntN(high - low)
	for i := range high - low {
		port := low + (start+i)%(high-low)
		if release, ok := TryReserve(port); ok {
			return port, release, nil
		}
	}
	return 0, nil, fmt.Errorf("no free port in %d-%d", low, high-1)
}

// Span is the ports handed out: a caller that needs ports at fixed offsets
// from a base (agentplane dev's layout) picks the base in it and reserves
// each port with TryReserve.
func Span() (from, to int) { return low, high }

// locks is the directory of the lock files, made once per process.
var locks = sync.OnceValues(func() (string, error) {
	dir := filepath.Join(os.TempDir(), "agentplane-test-ports")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	// Tests run as other uids too (testenv.AsUID): everyone may add a lock file.
	_ = os.Chmod(dir, 0o1777)
	return dir, nil
})

// TryReserve reserves port if it is free now and no other process holds it.
func TryReserve(port int) (release func(), ok bool) {
	dir, err := locks()
	if err != nil {
		return nil, false
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDONLY, 0o666)
	if err != nil {
		return nil, false // another uid's file: its port is someone else's
	}
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
		_ = f.Close()
		return nil, false
	}
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		_ = f.Close() // in use by something that takes no part in reservations
		return nil, false
	}
	_ = l.Close()
	return func() { _ = f.Close() }, true
}

// Listen is a TCP listener on a loopback port the kernel picks, closed when
// tb ends (closing it earlier is fine): for a server the test runs itself,
// which needs no reservation.
func Listen(tb testing.TB) net.Listener {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("testaddr: %v", err)
	}
	tb.Cleanup(func() { _ = l.Close() })
	return l
}
