package egress_test

import (
	"bufio"
	"crypto/rand"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/egress"
)

const downloadBytes = 50 << 20

// BenchmarkEgressDownload: a 50 MB download from a loopback server, directly
// and through the egress path a sandboxed runtime uses (the wrapper's
// loopback relay, the Unix socket, the proxy), in one run. Compare MB/s.
func BenchmarkEgressDownload(b *testing.B) {
	blob := make([]byte, downloadBytes)
	_, _ = rand.Read(blob)
	r, _ := startRigWith(b, egress.Limits{MaxConns: 64, Idle: time.Minute},
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(blob)))
			_, _ = w.Write(blob)
		}))
	for _, c := range []struct {
		name string
		url  string
		hc   *http.Client
	}{
		{"direct", r.plain.URL + "/blob", &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}},
		{"egress", r.url(r.plain, "http", "allowed.test"), r.client("")},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(downloadBytes)
			for b.Loop() {
				resp, err := c.hc.Get(c.url)
				require.NoError(b, err)
				n, err := io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				require.NoError(b, err)
				require.Equal(b, int64(downloadBytes), n)
			}
		})
	}
}

// BenchmarkEgressConnect: the time until a TCP stream to the server is
// usable, directly (connect) and through egress (connect to the relay,
// CONNECT, 200: the proxy authenticated the wrapper, matched the policy,
// resolved and dialled). The difference of the p50s is egress's added
// connect latency.
func BenchmarkEgressConnect(b *testing.B) {
	r, _ := startRigWith(b, egress.Limits{MaxConns: 64, Idle: time.Minute}, http.NotFoundHandler())
	target := "allowed.test:" + strconv.Itoa(int(port(r.plain)))
	for _, c := range []struct {
		name string
		dial func() net.Conn
	}{
		{"direct", func() net.Conn {
			conn, err := net.Dial("tcp", r.plain.Listener.Addr().String())
			require.NoError(b, err)
			return conn
		}},
		{"egress", func() net.Conn {
			conn, err := net.Dial("tcp", r.proxyURL.Host)
			require.NoError(b, err)
			_, err = io.WriteString(conn, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
			require.NoError(b, err)
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			require.NoError(b, err)
			require.Equal(b, http.StatusOK, resp.StatusCode)
			return conn
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			var ds []time.Duration
			for b.Loop() {
				start := time.Now()
				conn := c.dial()
				ds = append(ds, time.Since(start))
				_ = conn.Close()
			}
			slices.Sort(ds)
			b.ReportMetric(float64(ds[len(ds)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(ds[len(ds)*99/100].Microseconds()), "p99-µs")
		})
	}
}
