package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"syscall"
	"testing"
	"time"
)

// BenchmarkProxy compares, in one run, a request through the credential
// proxy with the same request sent to the upstream directly, and measures a
// Redis round trip to the same redis-server. hop is a bare
// httputil.ReverseProxy in front of the same upstream: the cost of any extra
// Go HTTP hop on this machine, without Redis or the proxy's own work.
// p50-µs is the median latency of one sequential request; the parallel
// variants give throughput (req/s) and the CPU time this process (client,
// proxy and upstream; not redis-server) spends per request (cpu-µs/req).
//
//	go test ./server -run '^$' -bench BenchmarkProxy -count 6 -benchtime 3000x
func BenchmarkProxy(b *testing.B) {
	h := startHarness(b)
	m := h.mint(b, "sbx-bench", "/w/repo", "s1", "sk-bench", wt, 100)
	rdb := h.rdb.Client(b)
	direct := h.up.srv.URL + "/base/bench"
	proxied := h.proxyURL + "/s/sbx-bench/provider/bench"
	up, _ := url.Parse(h.up.srv.URL)
	bare := httputil.NewSingleHostReverseProxy(up)
	bare.Transport = &http.Transport{MaxIdleConnsPerHost: 512}
	hopSrv := httptest.NewServer(bare)
	b.Cleanup(hopSrv.Close)
	hop := hopSrv.URL + "/base/bench"

	get := func(b *testing.B, url string, auth bool) {
		req, _ := http.NewRequest("GET", url, nil)
		if auth {
			req.Header.Set("Authorization", "Bearer "+m.handle)
		}
		resp, err := h.http.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
	latency := func(name string, op func(b *testing.B)) {
		b.Run(name, func(b *testing.B) {
			for range 50 { // warm connections and the resolution cache
				op(b)
			}
			d := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for b.Loop() {
				t := time.Now()
				op(b)
				d = append(d, time.Since(t))
			}
			slices.Sort(d)
			b.ReportMetric(float64(d[len(d)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(d[len(d)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
	}
	latency("redis_rtt", func(b *testing.B) {
		if err := rdb.Get(bg, "bench-missing").Err(); err != nil && err.Error() != "redis: nil" {
			b.Fatal(err)
		}
	})
	latency("direct", func(b *testing.B) { get(b, direct, false) })
	latency("hop", func(b *testing.B) { get(b, hop, false) })
	latency("proxy", func(b *testing.B) { get(b, proxied, true) })

	throughput := func(name, url string, auth bool) {
		b.Run(name, func(b *testing.B) {
			b.SetParallelism(8)
			cpu0, start := cpuTime(b), time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					get(b, url, auth)
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
			b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/req")
		})
	}
	throughput("direct_parallel", direct, false)
	throughput("hop_parallel", hop, false)
	throughput("proxy_parallel", proxied, true)
}

// cpuTime is the user+system CPU time this process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
