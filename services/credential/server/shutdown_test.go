package server

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A proxied request in flight when shutdown begins (a streamed completion,
// say) is served to its end before the service closes Redis and returns:
// the shutdown's close_redis step waits for the proxy. Before, RunWith
// returned as soon as the gRPC side had stopped, and the process exit cut
// such responses off.
func TestShutdownWaitsForProxiedRequests(t *testing.T) {
	h := startHarness(t)
	m := h.mint(t, "sbx-a", "/w/repo", "s1", "sk-backing", wt, 100)

	started, release := make(chan struct{}), make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "part1,")
		w.(http.Flusher).Flush()
		close(started)
		<-release
		_, _ = io.WriteString(w, "part2")
	}))
	t.Cleanup(slow.Close)
	var releaseOnce sync.Once
	let := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(let) // before slow.Close, which waits for the handler
	cfg := h.cfg
	cfg.BackendUpstream = slow.URL + "/backend"
	s := runService(t, cfg)
	t.Cleanup(func() { _ = s.stop() })

	req, err := http.NewRequest("GET", s.proxyURL+"/s/sbx-a/backend/stream", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+m.handle)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	<-started

	stopped := make(chan error, 1)
	go func() { stopped <- s.stop() }()
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", s.grpcAddr)
		if err == nil {
			c.Close()
		}
		return err != nil
	}, 10*time.Second, 10*time.Millisecond, "the gRPC side stops")
	time.Sleep(300 * time.Millisecond) // room for a premature return
	select {
	case err := <-stopped:
		t.Fatalf("the service returned while a proxied request was open (err %v)", err)
	default:
	}

	let()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, "part1,part2", string(body))
	require.NoError(t, <-stopped)
}
