package server

import (
	"io"
	"net/http"
	"slices"
	"testing"
	"time"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/services/credential/internal/handle"
)

// BenchmarkProxyRefusalTiming is issue 19's timing probe: the proxy's
// answer to a handle it must refuse should not tell an unknown handle from
// a revoked one or from another sandbox's. One loop sends, in turn, a
// well-formed handle never minted (unknown), a handle whose only member was
// released (revoked), a live handle of another sandbox that nobody used for
// a while (foreign_cold) and one its own sandbox uses right before every
// probe (foreign_warm: its resolution is in the proxy's cache), so every
// kind sees the same machine. It reports each kind's median latency and
// the largest difference between two medians (spread-µs).
//
//	go test ./server -run '^$' -bench BenchmarkProxyRefusalTiming -count 5 -benchtime 2000x
func BenchmarkProxyRefusalTiming(b *testing.B) {
	h := startHarness(b)
	unknown, err := handle.New(handle.Worktree)
	if err != nil {
		b.Fatal(err)
	}
	revoked := h.mint(b, "sbx-a", "/w/revoked", "s1", "sk-r", wt, 100)
	if _, err := h.client.ReleaseMember(bg, &credentialv1.ReleaseMemberRequest{
		Scope: &credentialv1.Scope{SandboxId: "sbx-a", Directory: "/w/revoked"}, SessionId: "s1", FenceToken: 100,
	}); err != nil {
		b.Fatal(err)
	}
	cold := h.mint(b, "sbx-b", "/w/cold", "s2", "sk-c", wt, 100)
	warm := h.mint(b, "sbx-c", "/w/warm", "s3", "sk-w", wt, 100)

	send := func(b *testing.B, path, handle string) (time.Duration, int) {
		req, _ := http.NewRequest("GET", h.proxyURL+path, nil)
		req.Header.Set("Authorization", "Bearer "+handle)
		start := time.Now()
		resp, err := h.http.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return time.Since(start), resp.StatusCode
	}
	kinds := []struct {
		name, handle string
		before       func(b *testing.B)
		want         int
	}{
		{"unknown", unknown, nil, http.StatusUnauthorized},
		{"revoked", revoked.handle, nil, http.StatusUnauthorized},
		{"foreign_cold", cold.handle, nil, http.StatusForbidden},
		{"foreign_warm", warm.handle, func(b *testing.B) {
			if _, code := send(b, "/s/sbx-c/provider/bench", warm.handle); code != http.StatusOK {
				b.Fatalf("own sandbox: status %d", code)
			}
		}, http.StatusForbidden},
	}
	probe := "/s/sbx-a/provider/bench"
	for range 100 { // warm connections
		for _, k := range kinds {
			send(b, probe, k.handle)
		}
	}
	lat := make([][]time.Duration, len(kinds))
	b.ResetTimer()
	for b.Loop() {
		for i, k := range kinds {
			if k.before != nil {
				k.before(b)
			}
			d, code := send(b, probe, k.handle)
			if code != k.want {
				b.Fatalf("%s: status %d, want %d", k.name, code, k.want)
			}
			lat[i] = append(lat[i], d)
		}
	}
	b.StopTimer()
	lo, hi := time.Duration(1<<62), time.Duration(0)
	for i, k := range kinds {
		slices.Sort(lat[i])
		p50 := lat[i][len(lat[i])/2]
		lo, hi = min(lo, p50), max(hi, p50)
		b.ReportMetric(float64(p50.Nanoseconds())/1e3, k.name+"-p50-µs")
	}
	b.ReportMetric(float64((hi-lo).Nanoseconds())/1e3, "spread-µs")
}
