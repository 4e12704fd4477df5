package proxy

import (
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// stalledUpstream accepts connections and, per connection, writes answer
// (possibly nothing) and then never sends another byte until the test ends.
func stalledUpstream(t *testing.T, answer string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	t.Cleanup(func() { close(done); _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				_, _ = c.Read(buf) // the request head
				_, _ = io.WriteString(c, answer)
				<-done
			}()
		}
	}()
	return "http://" + l.Addr().String()
}

// TestForwardUpstreamThatNeverAnswersTimesOut: an upstream that takes the
// request and never answers is a 502 after headerWait, not a connection
// held for as long as the caller waits (issue 31).
func TestForwardUpstreamThatNeverAnswersTimesOut(t *testing.T) {
	f := newForwarder()
	f.headerWait = 200 * time.Millisecond
	srv, errs := front(t, f, stalledUpstream(t, ""))
	c := &http.Client{Timeout: time.Minute} // far past headerWait: only the proxy's bound can end it first
	resp, err := c.Get(srv.URL + "/x")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadGateway, resp.StatusCode)
	require.Error(t, <-errs)
}

// TestForwardUpstreamStalledMidBodyTimesOut: an upstream that stops
// sending its body is cut after bodyIdle; the caller sees a truncated body.
func TestForwardUpstreamStalledMidBodyTimesOut(t *testing.T) {
	f := newForwarder()
	f.bodyIdle = 200 * time.Millisecond
	srv, errs := front(t, f, stalledUpstream(t, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"))
	c := &http.Client{Timeout: time.Minute}
	resp, err := c.Get(srv.URL + "/x")
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Error(t, err, "a truncated body, not a clean end")
	require.ErrorIs(t, <-errs, errAfterHeaders)
}
