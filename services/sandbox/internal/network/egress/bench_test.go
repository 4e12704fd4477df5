package egress_test

import (
	"bufio"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/network/egress"
	"agentplane.dev/services/sandbox/internal/network/socketrelay"
)

const downloadBytes = 50 << 20

// BenchmarkEgressDownload: a 50 MB download from a loopback server, directly
// and through the egress path a sandboxed runtime uses (the wrapper's
// loopback listener handing the connection to the proxy over the Unix
// socket, the proxy copying between it and the upstream), from the same
// server and the same bytes, each on a new connection. Two references
// relay the same client and server with nothing else (no policy, no
// accounting): a bare forwarder in user space (Go's io.Copy, which
// splices) and one in the kernel, a BPF sockmap that redirects each
// segment to the other socket (sockmap_test.go; it needs CAP_BPF, and the
// leg is left out with a word where it cannot load). Each iteration makes
// one of each, in rotating order, so a change of the machine's load falls
// on all alike. Two clients: Go's HTTP client in this process (8 KiB
// reads), and curl in its own, as a runtime would run it (its own
// %{time_total}, so its start costs nothing).
func BenchmarkEgressDownload(b *testing.B) {
	blob := make([]byte, downloadBytes)
	_, _ = rand.Read(blob)
	r, _ := startRigWith(b, egress.Limits{MaxConns: 64, Idle: time.Minute},
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(blob)))
			_, _ = w.Write(blob)
		}))
	upstream := r.plain.Listener.Addr().String()
	legs := []leg{
		newLeg("direct", r.plain.URL+"/blob", nil),
		newLeg("egress", r.url(r.plain, "http", "allowed.test"), r.proxyURL),
		newLeg("forwarder", "http://"+startForwarder(b, upstream)+"/blob", nil),
	}
	if inKernel, err := newSockmapForwarder(b); err != nil {
		b.Logf("no sockmap leg: %v", err)
	} else {
		legs = append(legs, newLeg("sockmap", "http://"+inKernel.start(b, upstream)+"/blob", nil))
	}
	for _, c := range []struct {
		name     string
		download func(b *testing.B, l leg) time.Duration
	}{{"go", goDownload}, {"curl", curlDownload}} {
		b.Run("client="+c.name, func(b *testing.B) {
			took := make([]time.Duration, len(legs))
			i := 0
			for b.Loop() {
				for k := range legs {
					l := (i + k) % len(legs)
					took[l] += c.download(b, legs[l])
				}
				i++
			}
			b.ReportMetric(float64(i)*downloadBytes/1e6/took[0].Seconds(), "direct-MB/s")
			for l := 1; l < len(legs); l++ {
				b.ReportMetric(took[0].Seconds()/took[l].Seconds(), legs[l].name+"/direct")
			}
		})
	}
}

// leg is one way to the download: a URL, through an HTTP proxy or not,
// and the Go client that takes it.
type leg struct {
	name, url string
	proxy     *url.URL
	hc        *http.Client
}

func newLeg(name, u string, proxy *url.URL) leg {
	return leg{name: name, url: u, proxy: proxy,
		hc: &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxy), DisableKeepAlives: true}}}
}

func goDownload(b *testing.B, l leg) time.Duration {
	start := time.Now()
	resp, err := l.hc.Get(l.url)
	require.NoError(b, err)
	n, err := io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	require.NoError(b, err)
	require.Equal(b, int64(downloadBytes), n)
	return time.Since(start)
}

func curlDownload(b *testing.B, l leg) time.Duration {
	args := []string{"-sS", "-m", "30", "-o", "/dev/null", "-w", "%{size_download} %{time_total}"}
	if l.proxy != nil {
		args = append(args, "-x", l.proxy.String())
	}
	var stderr strings.Builder
	cmd := exec.Command("curl", append(args, l.url)...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(b, err, stderr.String())
	var size int64
	var secs float64
	_, err = fmt.Sscan(string(out), &size, &secs)
	require.NoError(b, err, string(out))
	require.Equal(b, int64(downloadBytes), size)
	return time.Duration(secs * float64(time.Second))
}

// startForwarder relays each connection to upstream and back with nothing
// else.
func startForwarder(b *testing.B, upstream string) string {
	return serveLoopback(b, func(c net.Conn) {
		defer c.Close()
		up, err := net.Dial("tcp", upstream)
		if err != nil {
			return
		}
		defer up.Close()
		go func() { _, _ = io.Copy(up, c); _ = up.Close() }() // c closed (the client, or the benchmark's end): up too
		_, _ = io.Copy(c, up)
	})
}

// serveLoopback runs handle for each connection of a new loopback
// listener until the benchmark ends, and returns its address.
func serveLoopback(b *testing.B, handle func(net.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	done := make(chan struct{})
	go func() { socketrelay.Accept(ln, handle); close(done) }()
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
