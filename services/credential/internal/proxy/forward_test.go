package proxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// front is a real HTTP server whose handler forwards every request to
// upstream with f, answering 502 on an error before the response started.
func front(t *testing.T, f *forwarder, upstream string) (*httptest.Server, chan error) {
	errs := make(chan error, 16)
	base, err := url.Parse(upstream)
	require.NoError(t, err)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u := *base
		u.Path = r.URL.Path
		out := &http.Request{Method: r.Method, URL: &u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
			Header: r.Header, Body: r.Body, ContentLength: r.ContentLength}
		if r.ContentLength == 0 {
			out.Body = nil
		}
		err := f.forward(r.Context(), w, out, echoGuard{}, nil)
		errs <- err
		if err != nil && !errors.Is(err, errAfterHeaders) {
			w.WriteHeader(http.StatusBadGateway)
		}
	}))
	t.Cleanup(func() { srv.Close(); f.closeIdle() })
	return srv, errs
}

func TestForwardStreamsRequestBody(t *testing.T) {
	firstChunk := make(chan string, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		buf := make([]byte, 5)
		_, _ = io.ReadFull(r.Body, buf)
		firstChunk <- string(buf) // before the caller sent the rest
		rest, _ := io.ReadAll(r.Body)
		_, _ = io.WriteString(w, string(buf)+string(rest))
	}))
	defer up.Close()
	srv, _ := front(t, newForwarder(), up.URL)

	pr, pw := io.Pipe()
	done := make(chan string, 1)
	go func() {
		resp, err := http.Post(srv.URL+"/echo", "text/plain", pr) // unknown length: chunked
		if err != nil {
			done <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- string(b)
	}()
	_, _ = io.WriteString(pw, "hello")
	require.Equal(t, "hello", <-firstChunk)
	_, _ = io.WriteString(pw, " world")
	require.NoError(t, pw.Close())
	require.Equal(t, "hello world", <-done)
}

func TestForwardFlushesStreamingResponse(t *testing.T) {
	next := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: one\n\n")
		w.(http.Flusher).Flush()
		<-next // the second event only after the caller saw the first
		_, _ = io.WriteString(w, "data: two\n\n")
	}))
	defer up.Close()
	srv, _ := front(t, newForwarder(), up.URL)

	resp, err := http.Get(srv.URL + "/v1/chat/completions")
	require.NoError(t, err)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "data: one\n", line)
	close(next)
	rest, err := io.ReadAll(br)
	require.NoError(t, err)
	require.Equal(t, "\ndata: two\n\n", string(rest))
}

func TestForwardReusesConnectionsAndSurvivesUpstreamIdleClose(t *testing.T) {
	var conns atomic.Int32
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}))
	up.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	up.Start()
	defer up.Close()
	srv, _ := front(t, newForwarder(), up.URL)
	get := func() string {
		resp, err := http.Get(srv.URL + "/x")
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.Status + " " + string(b)
	}
	for range 3 {
		require.Equal(t, "200 OK ok", get())
	}
	require.EqualValues(t, 1, conns.Load(), "sequential requests share one keep-alive connection")

	up.CloseClientConnections() // the upstream drops the idle connection
	require.Equal(t, "200 OK ok", get(), "a closed idle connection is not reused")
	require.EqualValues(t, 2, conns.Load())
}

func TestForwardUpstreamDownIs502(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close()) // nothing listens there now
	srv, errs := front(t, newForwarder(), "http://"+addr)
	resp, err := http.Get(srv.URL + "/x")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadGateway, resp.StatusCode)
	require.Error(t, <-errs)
}

func TestForwardUpstreamResetMidBodyAbortsResponse(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Length", "100")
		_, _ = io.WriteString(w, "partial")
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler) // the upstream dies mid-body
	}))
	up.Config.ErrorLog = nil
	defer up.Close()
	srv, errs := front(t, newForwarder(), up.URL)
	resp, err := http.Get(srv.URL + "/x")
	require.NoError(t, err)
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Error(t, err, "the caller must see a truncated body, not a clean end")
	require.ErrorIs(t, <-errs, errAfterHeaders)
}

func TestForwardCallerCancelReachesUpstream(t *testing.T) {
	upstreamGone := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		<-r.Context().Done() // the proxy closed the upstream connection
		close(upstreamGone)
	}))
	defer up.Close()
	srv, errs := front(t, newForwarder(), up.URL)
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/slow", nil)
	require.NoError(t, err)
	go func() {
		time.Sleep(50 * time.Millisecond)
		cancel()
	}()
	_, err = http.DefaultClient.Do(req)
	require.Error(t, err)
	select {
	case <-upstreamGone:
	case <-time.After(10 * time.Second):
		t.Fatal("the upstream request was not cancelled")
	}
	require.Error(t, <-errs)
	http.DefaultClient.CloseIdleConnections()
}

func TestForwardDoesNotFollowRedirectsOrLeakResponseHeaders(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Set-Cookie", "a=b")
		w.Header().Set("Connection", "X-Named")
		w.Header().Set("X-Named", "1")
		w.Header().Set("X-Agentplane-Attestation", "leak")
		http.Redirect(w, r, "/elsewhere", http.StatusFound)
	}))
	defer up.Close()
	srv, _ := front(t, newForwarder(), up.URL)
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := c.Get(srv.URL + "/r")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusFound, resp.StatusCode)
	require.Equal(t, "/elsewhere", resp.Header.Get("Location"))
	for _, h := range []string{"Set-Cookie", "X-Named", "X-Agentplane-Attestation"} {
		require.Empty(t, resp.Header.Get(h), h)
	}
	require.NotContains(t, resp.Header.Get("Connection"), "X-Named")
	c.CloseIdleConnections()
}

// countingConn counts the writes to the connection (each one a syscall on
// a real socket).
type countingConn struct {
	net.Conn
	writes int
}

func (c *countingConn) Write(p []byte) (int, error) { c.writes++; return c.Conn.Write(p) }

func TestForwardSendsSmallRequestInOneWrite(t *testing.T) {
	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	cc := &countingConn{Conn: client}
	uc := newUpstreamConn("", cc, 0)
	got := make(chan string, 1)
	go func() {
		req, err := http.ReadRequest(bufio.NewReader(server))
		if err != nil {
			got <- err.Error()
			return
		}
		b, _ := io.ReadAll(req.Body)
		got <- string(b)
		_, _ = io.WriteString(server, "HTTP/1.1 204 No Content\r\n\r\n")
	}()
	body := `{"model":"m"}`
	u, _ := url.Parse("http://upstream.test/v1/chat/completions")
	out := &http.Request{Method: "POST", URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"application/json"}}, Body: io.NopCloser(&onlyReader{strings.NewReader(body)}), ContentLength: int64(len(body))}
	resp, err := exchange(context.Background(), uc, out, 0)
	require.NoError(t, err)
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	require.Equal(t, body, <-got)
	require.Equal(t, 1, cc.writes, "head and body in one write")
}

// onlyReader hides the concrete reader type, as a server request body does.
type onlyReader struct{ r io.Reader }

func (o *onlyReader) Read(p []byte) (int, error) { return o.r.Read(p) }
