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
// loopback listener handing the connection to the proxy over the Unix
// socket, the proxy splicing it with the upstream), from the same server
// and the same bytes, both on a new connection each time. Each iteration makes one
// of each, in alternating order, so a change of the machine's load falls on
// both alike: compare direct-MB/s, egress-MB/s and their ratio.
func BenchmarkEgressDownload(b *testing.B) {
	blob := make([]byte, downloadBytes)
	_, _ = rand.Read(blob)
	r, _ := startRigWith(b, egress.Limits{MaxConns: 64, Idle: time.Minute},
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(blob)))
			_, _ = w.Write(blob)
		}))
	direct := &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	viaEgress := r.client("")
	download := func(hc *http.Client, url string) time.Duration {
		start := time.Now()
		resp, err := hc.Get(url)
		require.NoError(b, err)
		n, err := io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		require.NoError(b, err)
		require.Equal(b, int64(downloadBytes), n)
		return time.Since(start)
	}
	var d, e time.Duration
	i := 0
	for b.Loop() {
		if i%2 == 0 {
			d += download(direct, r.plain.URL+"/blob")
			e += download(viaEgress, r.url(r.plain, "http", "allowed.test"))
		} else {
			e += download(viaEgress, r.url(r.plain, "http", "allowed.test"))
			d += download(direct, r.plain.URL+"/blob")
		}
		i++
	}
	mbps := func(t time.Duration) float64 { return float64(i) * downloadBytes / 1e6 / t.Seconds() }
	b.ReportMetric(mbps(d), "direct-MB/s")
	b.ReportMetric(mbps(e), "egress-MB/s")
	b.ReportMetric(d.Seconds()/e.Seconds(), "egress/direct")
}

// BenchmarkEgressConnect: the time until a TCP stream to the server is
// usable, directly (connect) and through egress (connect to the wrapper's
// listener, its handoff, CONNECT, 200: the proxy authenticated the
// wrapper, matched the policy, resolved and dialled). The difference of the
// p50s is egress's added connect latency.
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
