package egress_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"agentplane.dev/services/sandbox/internal/network/egress"
	"agentplane.dev/services/sandbox/internal/network/egresshandoff"
	"agentplane.dev/services/sandbox/internal/network/socketrelay"
)

const goodPreamble = "AGENTPLANE-EGRESS/1 sb1 i1 Y3JlZC0x\n" // cred-1

// openFDs counts this process's descriptors: the proxy runs in it, so a
// descriptor it received and kept shows here.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// tcpPair is a connected loopback TCP pair: accepted (what a wrapper
// hands off) and dialed (the runtime's end, to watch what the proxy does).
func tcpPair(t *testing.T) (accepted, dialed *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	d, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	a, err := ln.Accept()
	require.NoError(t, err)
	return a.(*net.TCPConn), d.(*net.TCPConn)
}

// fileFD is a dup of f's descriptor, owned by the caller.
func fileFD(t *testing.T, f syscall.Conn) int {
	t.Helper()
	rc, err := f.SyscallConn()
	require.NoError(t, err)
	var fd int
	require.NoError(t, rc.Control(func(s uintptr) { fd, err = unix.Dup(int(s)) }))
	require.NoError(t, err)
	return fd
}

// The handoff socket is reachable from inside every sandbox, so a hostile
// runtime can send it anything: no descriptor, several, one that is not a
// connected TCP socket, a forged or malformed preamble. Each is refused
// (the proxy closes the Unix connection and every descriptor it got, and
// serves nothing on them), counted as unauthenticated, and nothing leaks.
// A preamble naming a sandbox another replica owns is answered "not the
// owner" and its socket left untouched; a connection that sends nothing (a
// replica's start probing the sockets) is no decision.
func TestEgressRefusesAHostileHandoff(t *testing.T) {
	dir := t.TempDir()
	decisions := egress.NewDecisions()
	p := egress.New(egress.Config{Decisions: decisions, Authorize: func(_ context.Context, id egresshandoff.Identity) (egress.Grant, error) {
		if id.SandboxID == "sb-elsewhere" {
			return egress.Grant{}, egress.ErrNotOwner
		}
		if id.Credential != "cred-1" {
			return egress.Grant{}, errors.New("bad credential")
		}
		return egress.Grant{Key: id.SandboxID}, nil
	}})
	sock := filepath.Join(dir, "a.sock")
	ln, err := socketrelay.Listen(sock)
	require.NoError(t, err)
	served := make(chan struct{})
	go func() { p.Serve(ln); close(served) }()
	defer func() { _ = ln.Close(); <-served }()
	refused := func() float64 {
		return testutil.ToFloat64(decisions.WithLabelValues(egress.Denied, egress.ReasonUnauthenticated))
	}

	// send writes b with fds in one sendmsg, closes the test's copies of
	// fds, and waits for the proxy to close the Unix connection; it
	// returns the proxy's answer (nothing: refused).
	send := func(name, b string, fds ...int) string {
		t.Helper()
		c, err := net.Dial("unix", sock)
		require.NoError(t, err, name)
		defer c.Close()
		var oob []byte
		if len(fds) > 0 {
			oob = unix.UnixRights(fds...)
		}
		_, _, err = c.(*net.UnixConn).WriteMsgUnix([]byte(b), oob, nil)
		require.NoError(t, err, name)
		for _, fd := range fds {
			require.NoError(t, unix.Close(fd), name)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		answer, err := io.ReadAll(c)
		require.NoError(t, err, name+": the proxy closes the handoff")
		return string(answer)
	}
	refusedHandoff := func(name, b string, fds ...int) {
		t.Helper()
		require.Empty(t, send(name, b, fds...), name+": no answer")
	}
	// closedUnanswered: the proxy closed its copy of the runtime's end
	// without writing a byte.
	closedUnanswered := func(name string, dialed net.Conn) {
		t.Helper()
		_ = dialed.SetReadDeadline(time.Now().Add(5 * time.Second))
		b, err := io.ReadAll(dialed)
		require.NoError(t, err, name)
		require.Empty(t, b, name)
		_ = dialed.Close()
	}

	baseFDs := openFDs(t)
	before := refused()
	cases := 0

	refusedHandoff("no descriptor", goodPreamble)
	cases++

	a1, d1 := tcpPair(t)
	a2, d2 := tcpPair(t)
	refusedHandoff("two descriptors", goodPreamble, fileFD(t, a1), fileFD(t, a2))
	_ = a1.Close()
	_ = a2.Close()
	closedUnanswered("two descriptors, first", d1)
	closedUnanswered("two descriptors, second", d2)
	cases++

	var many []int
	var dialedMany []net.Conn
	for range 5 { // past the read's room: MSG_CTRUNC, the kernel discards the rest
		a, d := tcpPair(t)
		many = append(many, fileFD(t, a))
		_ = a.Close()
		dialedMany = append(dialedMany, d)
	}
	refusedHandoff("five descriptors", goodPreamble, many...)
	for _, d := range dialedMany {
		closedUnanswered("five descriptors", d)
	}
	cases++

	var pipe [2]int
	require.NoError(t, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	refusedHandoff("a pipe", goodPreamble, pipe[1])
	n, err := unix.Read(pipe[0], make([]byte, 1))
	require.NoError(t, err)
	require.Zero(t, n, "the proxy closed the pipe's write end unwritten")
	require.NoError(t, unix.Close(pipe[0]))
	cases++

	f, err := os.CreateTemp(t.TempDir(), "regular")
	require.NoError(t, err)
	refusedHandoff("a regular file", goodPreamble, fileFD(t, f))
	require.NoError(t, f.Close())
	cases++

	udp, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	refusedHandoff("a datagram socket", goodPreamble, fileFD(t, udp.(*net.UDPConn)))
	require.NoError(t, udp.Close())
	cases++

	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	refusedHandoff("a Unix stream socket", goodPreamble, pair[1])
	n, err = unix.Read(pair[0], make([]byte, 1))
	require.NoError(t, err)
	require.Zero(t, n, "the proxy closed the other end unwritten")
	require.NoError(t, unix.Close(pair[0]))
	cases++

	lst, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	refusedHandoff("a TCP listener", goodPreamble, fileFD(t, lst.(*net.TCPListener)))
	require.NoError(t, lst.Close())
	cases++

	for _, c := range []struct{ name, preamble string }{
		{"no preamble", "GET http://allowed.test/ HTTP/1.1\r\n\r\n"},
		{"a preamble without its newline", "AGENTPLANE-EGRESS/1 sb1 i1 Y3JlZC0x"},
		{"bytes past the preamble", goodPreamble + "GET http://allowed.test/ HTTP/1.1\r\n\r\n"},
		{"a bad credential encoding", "AGENTPLANE-EGRESS/1 sb1 i1 !!\n"},
	} {
		a, d := tcpPair(t)
		refusedHandoff(c.name, c.preamble, fileFD(t, a))
		_ = a.Close()
		closedUnanswered(c.name, d)
		cases++
	}

	// A forged wrapper: a well-formed preamble that does not authenticate.
	// Its connection is answered 407 and closed; nothing is proxied.
	a, d := tcpPair(t)
	_, err = io.WriteString(d, "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
	require.NoError(t, err)
	require.Equal(t, "A", send("a forged wrapper", "AGENTPLANE-EGRESS/1 sb1 i1 Zm9yZ2Vk\n", fileFD(t, a)),
		"the owner takes it, to refuse it")
	_ = a.Close()
	_ = d.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(d), nil)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusProxyAuthRequired, resp.StatusCode)
	_ = d.Close()
	cases++

	// Another replica's wrapper: answered "not the owner"; the proxy wrote
	// nothing to the runtime's socket and kept no copy (the wrapper's copy,
	// a here, still holds it open, and its close is the runtime's EOF).
	a, d = tcpPair(t)
	require.Equal(t, "N", send("another replica's wrapper", "AGENTPLANE-EGRESS/1 sb-elsewhere i1 Y3JlZC0x\n", fileFD(t, a)))
	_ = d.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	n, err = d.Read(make([]byte, 1))
	require.Zero(t, n)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "the connection is still open, unwritten")
	_ = a.Close()
	closedUnanswered("another replica's wrapper", d)

	// A probe: connects and sends nothing.
	probe, err := net.Dial("unix", sock)
	require.NoError(t, err)
	require.NoError(t, probe.(*net.UnixConn).CloseWrite())
	_ = probe.SetReadDeadline(time.Now().Add(5 * time.Second))
	answer, err := io.ReadAll(probe)
	require.NoError(t, err)
	require.Empty(t, answer)
	_ = probe.Close()

	require.Eventually(t, func() bool { return refused() == before+float64(cases) }, 5*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return openFDs(t) <= baseFDs }, 5*time.Second, 10*time.Millisecond,
		"every descriptor a refused handoff carried is closed")
}

// A wrapper's handoff leaves no descriptor behind on either side, however
// the connection ends.
func TestEgressHandoffLeaksNothing(t *testing.T) {
	r, _ := startRig(t, egress.Limits{MaxConns: 64, Idle: time.Minute}, "hello")
	hc := r.client("")
	_, _, err := get(t, hc, r.url(r.plain, "http", "allowed.test")) // warm: the servers' and the client's first descriptors
	require.NoError(t, err)
	hc.CloseIdleConnections()
	base := openFDs(t)
	for range 20 {
		code, _, err := get(t, hc, r.url(r.plain, "http", "allowed.test"))
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, code)
		code, _, err = get(t, hc, r.url(r.plain, "http", "denied.test"))
		require.NoError(t, err)
		require.Equal(t, http.StatusForbidden, code)
		_, _, err = get(t, hc, r.url(r.tls, "https", "allowed.test"))
		require.NoError(t, err)
	}
	hc.CloseIdleConnections()
	require.Eventually(t, func() bool { return openFDs(t) <= base }, 5*time.Second, 10*time.Millisecond)
}

// Every sandbox-service replica of a node serves a socket of the egress
// directory, and only the owner of the wrapper's sandbox can judge it: the
// wrapper offers each connection to the sockets in name order — past a
// dead replica's socket and a replica that answers "not the owner" — until
// one takes it. The non-owner counts nothing and keeps nothing; a sandbox
// no replica owns gets the wrapper's own 503 no_owner, which a package
// manager retries.
func TestEgressHandoffFindsTheOwner(t *testing.T) {
	r, metric := startRig(t, egress.Limits{MaxConns: 64, Idle: time.Minute}, "hello")
	stale, err := net.Listen("unix", filepath.Join(r.dir, "0.sock")) // sorts first; its replica is gone
	require.NoError(t, err)
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, stale.Close())
	other := r.addReplica(t, "1.sock") // sorts before the owner's a.sock
	otherCount := func() float64 {
		n := 0.0
		for _, m := range []string{egress.Allowed, egress.Denied} {
			for _, reason := range []string{egress.ReasonPolicy, egress.ReasonUnauthenticated, egress.ReasonNotAllowed} {
				n += testutil.ToFloat64(other.WithLabelValues(m, reason))
			}
		}
		return n
	}
	hc := r.client("")
	_, _, err = get(t, hc, r.url(r.plain, "http", "allowed.test")) // warm
	require.NoError(t, err)
	base := openFDs(t)
	for range 10 {
		code, body, err := get(t, hc, r.url(r.plain, "http", "allowed.test"))
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, code)
		require.Contains(t, body, "hello allowed.test:")
		_, _, err = get(t, hc, r.url(r.tls, "https", "allowed.test"))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return metric(egress.Allowed, egress.ReasonPolicy) == 21 }, 5*time.Second, 10*time.Millisecond,
		"the owner served every one (counted as each ends)")
	require.Zero(t, otherCount(), "the other replica decided nothing")
	hc.CloseIdleConnections()
	require.Eventually(t, func() bool { return openFDs(t) <= base }, 5*time.Second, 10*time.Millisecond)

	// A wrapper of a sandbox no replica owns.
	front, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	accepted := make(chan struct{})
	go func() {
		socketrelay.Accept(front, egresshandoff.Handler(r.dir, egresshandoff.Identity{SandboxID: "sb-none", Instance: "i1", Credential: "cred-1"}))
		close(accepted)
	}()
	defer func() { _ = front.Close(); <-accepted }()
	c, err := net.Dial("tcp", front.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_, err = io.WriteString(c, "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
	require.NoError(t, err)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Equal(t, egresshandoff.ReasonNoOwner, resp.Header.Get("X-Agentplane-Egress"))
	require.Zero(t, otherCount())
	require.Zero(t, metric(egress.Denied, egress.ReasonUnauthenticated))
}
