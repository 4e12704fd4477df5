package socketrelay

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if path := os.Getenv("RELAY_FLOOD"); path != "" {
		os.Exit(flood(path))
	}
	goleak.VerifyTestMain(m)
}

// loopback → Unix socket → TCP upstream, as the wrapper and the sandbox
// service chain them, with a real HTTP server at the end.
func TestChainReachesUpstream(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "answer for "+r.URL.Path)
	}))
	defer up.Close()
	dir := t.TempDir()
	stale := filepath.Join(dir, "0-stale.sock")
	ln0, err := net.Listen("unix", stale)
	require.NoError(t, err)
	ln0.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, ln0.Close()) // a replica that died: its file stays, nobody listens

	outer, err := Listen(filepath.Join(dir, "r1.sock"))
	require.NoError(t, err)
	require.NoFileExists(t, stale, "sockets nobody serves are removed")
	fi, err := os.Stat(filepath.Join(dir, "r1.sock"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o666), fi.Mode().Perm())
	done1 := make(chan struct{})
	go func() {
		Serve(outer, func() (net.Conn, error) { return net.Dial("tcp", up.Listener.Addr().String()) })
		close(done1)
	}()

	inner, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done2 := make(chan struct{})
	go func() { Serve(inner, func() (net.Conn, error) { return DialDir(dir) }); close(done2) }()

	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + inner.Addr().String() + "/s/sb1/provider/x")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, "answer for /s/sb1/provider/x", string(body))

	require.NoError(t, inner.Close())
	require.NoError(t, outer.Close())
	<-done1
	<-done2
}

func TestDialDirWithoutSockets(t *testing.T) {
	_, err := DialDir(t.TempDir())
	require.Error(t, err)
	_, err = DialDir(filepath.Join(t.TempDir(), "missing"))
	require.Error(t, err)
}

// Closing the listener ends a joined connection whose caller has
// half-closed it while the upstream keeps its side open (an idle
// keep-alive server, or one that never answers): Serve returns once both
// ends are closed. (The sandbox
// service's shutdown waited on such a connection until the wrapper holding
// it was killed, and dev kills wrappers only after the service returns.)
func TestServeEndsAHalfClosedJoinOnClose(t *testing.T) {
	up, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer up.Close()
	sawEOF, release, upEnded := make(chan struct{}), make(chan struct{}), make(chan struct{})
	defer func() { close(release); <-upEnded }()
	go func() {
		defer close(upEnded)
		c, err := up.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.Copy(io.Discard, c) // reads the caller's bytes and its half-close, answers nothing
		close(sawEOF)
		<-release // and keeps its side open
	}()
	ln, err := Listen(filepath.Join(t.TempDir(), "r.sock"))
	require.NoError(t, err)
	served := make(chan struct{})
	go func() {
		defer close(served)
		Serve(ln, func() (net.Conn, error) { return net.Dial("tcp", up.Addr().String()) })
	}()
	c, err := net.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	_, err = io.WriteString(c, "request")
	require.NoError(t, err)
	require.NoError(t, c.(*net.UnixConn).CloseWrite())
	<-sawEOF // the half-close has passed the relay: only the upstream's direction is left

	require.NoError(t, ln.Close())
	select {
	case <-served:
	case <-time.After(time.Minute): // a bound against hanging, not a measure
		t.Fatal("Serve did not return after its listener closed: a half-closed join holds it")
	}
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "the caller's connection is closed too")
}
