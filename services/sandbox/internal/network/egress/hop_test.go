package egress_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/network/egress"
)

// TestEgressDropsHopByHopHeaders sends a plain-HTTP request through the
// proxy to a real upstream that answers with the headers it received:
// the hop-by-hop ones and every header a Connection header names stop at
// the proxy; the others arrive.
func TestEgressDropsHopByHopHeaders(t *testing.T) {
	r, _ := startRigWith(t, egress.Limits{}, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_ = json.NewEncoder(w).Encode(req.Header)
	}))
	c, err := net.Dial("tcp", r.proxyURL.Host)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(30*time.Second)))
	host := fmt.Sprintf("allowed.test:%d", port(r.plain))
	_, err = fmt.Fprintf(c, "GET http://%s/x HTTP/1.1\r\nHost: %s\r\n"+
		"Connection: keep-alive, X-Named-One\r\nConnection: x-named-two\r\n"+
		"X-Named-One: 1\r\nX-Named-Two: 2\r\nX-Kept: 3\r\n"+
		"Keep-Alive: timeout=5\r\nTe: trailers\r\nUpgrade: h2c\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic eDp5\r\n\r\n",
		host, host)
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var got http.Header
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&got))
	require.Equal(t, "3", got.Get("X-Kept"), "an ordinary header arrives: %v", got)
	for _, h := range []string{"X-Named-One", "X-Named-Two", "Keep-Alive", "Te", "Upgrade", "Proxy-Connection", "Proxy-Authorization"} {
		require.Empty(t, got.Values(h), "%s stops at the proxy: %v", h, got)
	}
	require.Equal(t, []string{"close"}, got.Values("Connection"), "only the proxy's own Connection: close")
}
