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
	"agentplane.dev/services/sandbox/internal/relay"
)

const downloadBytes = 50 << 20

// BenchmarkEgressDownload: a 50 MB download from a loopback server, directly
// and through the egress path a sandboxed runtime uses (the wrapper's
// loopback listener handing the connection to the proxy over the Unix
// socket, the proxy splicing it with the upstream), from the same server
// and the same bytes, each on a new connection. A third leg is the floor of
// any relay in user space: a bare TCP forwarder (no policy, no accounting;
// Go's io.Copy, which splices) between the same client and server. A fourth
// is the floor of a relay in the kernel: a BPF sockmap that redirects each
// segment to the other socket (sockmap_test.go; it needs CAP_BPF, and the
// leg is left out with a word where it cannot load). Each iteration makes
// one of each, in rotating order, so a change of the machine's load falls
// on all alike: compare egress/direct with forwarder/direct and
// sockmap/direct.
func BenchmarkEgressDownload(b *testing.B) {
	blob := make([]byte, downloadBytes)
	_, _ = rand.Read(blob)
	r, _ := startRigWith(b, egress.Limits{MaxConns: 64, Idle: time.Minute},
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(blob)))
			_, _ = w.Write(blob)
		}))
	fwd := startForwarder(b, r.plain.Listener.Addr().String())
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
	legs := []func() time.Duration{
		func() time.Duration { return download(direct, r.plain.URL+"/blob") },
		func() time.Duration { return download(viaEgress, r.url(r.plain, "http", "allowed.test")) },
		func() time.Duration { return download(direct, "http://"+fwd+"/blob") },
	}
	inKernel, err := newSockmapForwarder(b)
	if err != nil {
		b.Logf("no sockmap leg: %v", err)
	} else {
		viaSockmap := inKernel.start(b, r.plain.Listener.Addr().String())
		legs = append(legs, func() time.Duration { return download(direct, "http://"+viaSockmap+"/blob") })
	}
	took := make([]time.Duration, len(legs))
	i := 0
	for b.Loop() {
		for k := range legs {
			leg := (i + k) % len(legs)
			took[leg] += legs[leg]()
		}
		i++
	}
	mbps := func(t time.Duration) float64 { return float64(i) * downloadBytes / 1e6 / t.Seconds() }
	b.ReportMetric(mbps(took[0]), "direct-MB/s")
	b.ReportMetric(mbps(took[1]), "egress-MB/s")
	b.ReportMetric(took[0].Seconds()/took[1].Seconds(), "egress/direct")
	b.ReportMetric(took[0].Seconds()/took[2].Seconds(), "forwarder/direct")
	if len(took) > 3 {
		b.ReportMetric(took[0].Seconds()/took[3].Seconds(), "sockmap/direct")
	}
}

// startForwarder relays each connection to upstream and back with nothing
// else: the reference a proxy in user space cannot beat.
func startForwarder(b *testing.B, upstream string) string {
	return serveLoopback(b, func(c net.Conn) {
		defer c.Close()
		up, err := net.Dial("tcp", upstream)
		if err != nil {
			return
		}
		defer up.Close()
		go func() { _, _ = io.Copy(up, c) }()
		_, _ = io.Copy(c, up)
	})
}

// serveLoopback runs handle for each connection of a new loopback
// listener until the benchmark ends, and returns its address.
func serveLoopback(b *testing.B, handle func(net.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	done := make(chan struct{})
	go func() { relay.Accept(ln, handle); close(done) }()
	b.Cleanup(func() { _ = ln.Close(); <-done })
	return ln.Addr().String()
}

// BenchmarkEgressConnect: the time until a TCP stream to the server is
// usable, directly (connect) and through egress (connect to the wrapper's
// listener, its handoff, CONNECT, 200: the proxy authenticated the
// wrapper, matched the policy, resolved and dialled). The difference of the
// p50s is egress's added connect latency. The last leg adds another
// replica's socket that sorts before the owner's: the wrapper's handoff
// to it, answered "not the owner", comes first.
func BenchmarkEgressConnect(b *testing.B) {
	r, _ := startRigWith(b, egress.Limits{MaxConns: 64, Idle: time.Minute}, http.NotFoundHandler())
	target := "allowed.test:" + strconv.Itoa(int(port(r.plain)))
	viaEgress := func() net.Conn {
		conn, err := net.Dial("tcp", r.proxyURL.Host)
		require.NoError(b, err)
		_, err = io.WriteString(conn, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
		require.NoError(b, err)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		require.NoError(b, err)
		require.Equal(b, http.StatusOK, resp.StatusCode)
		return conn
	}
	for _, c := range []struct {
		name string
		dial func() net.Conn
	}{
		{"direct", func() net.Conn {
			conn, err := net.Dial("tcp", r.plain.Listener.Addr().String())
			require.NoError(b, err)
			return conn
		}},
		{"egress", viaEgress},
		{"egress-owner-second", viaEgress},
	} {
		if c.name == "egress-owner-second" {
			r.addReplica(b, "0.sock")
		}
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
