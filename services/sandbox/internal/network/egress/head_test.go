package egress_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/network/egress"
)

// rssBytes is this process's resident set (VmRSS of /proc/self/status).
func rssBytes(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// repeat is an endless stream of one byte, so a sender of 200 MiB holds
// none of it.
type repeat byte

func (r repeat) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(r)
	}
	return len(p), nil
}

// sendHead writes head, then n bytes of filler, then ends, on a connection
// to the rig's egress address, and returns the answer's status and reason.
func sendHead(t *testing.T, r *rig, head string, filler byte, n int64) (int, string) {
	t.Helper()
	c, err := net.Dial("tcp", r.proxyURL.Host)
	require.NoError(t, err)
	defer c.Close()
	go func() {
		if _, err := io.WriteString(c, head); err == nil {
			_, _ = io.Copy(c, io.LimitReader(repeat(filler), n)) // fails once the proxy closed: that is the point
		}
	}()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("X-Agentplane-Egress")
}

// TestEgressRequestHeadBounds: a runtime's request line past
// MaxRequestLine is 414, a header block past MaxRequestHeaders fields or
// MaxRequestHeaderBytes is 431 (issue 31: 10,000 headers were forwarded,
// and a 200 MiB request line, then 200 MiB of headers, took the sandbox
// service from 36 MiB to 1 GiB of memory). The service's RSS, measured
// here in the process that runs the proxy, grows by less than 64 MiB.
func TestEgressRequestHeadBounds(t *testing.T) {
	r, decisions := startRig(t, egress.Limits{}, "ok")
	debug.FreeOSMemory()
	before := rssBytes(t)

	code, reason := sendHead(t, r, "GET http://allowed.test/", 'a', 200<<20)
	require.Equal(t, http.StatusRequestURITooLong, code)
	require.Equal(t, egress.ReasonRequestLineTooLong, reason)

	code, reason = sendHead(t, r, "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nX-Big: ", 'b', 200<<20)
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, code)
	require.Equal(t, egress.ReasonHeadersTooLarge, reason)

	var many strings.Builder
	many.WriteString("GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n")
	for i := range 10000 {
		fmt.Fprintf(&many, "X-%d: v\r\n", i)
	}
	many.WriteString("\r\n")
	code, reason = sendHead(t, r, many.String(), 0, 0)
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, code, "10,000 headers")
	require.Equal(t, egress.ReasonHeadersTooLarge, reason)

	var few strings.Builder
	few.WriteString("GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n")
	for i := range egress.MaxRequestHeaders + 1 {
		fmt.Fprintf(&few, "X-%d: v\r\n", i)
	}
	few.WriteString("\r\n")
	code, _ = sendHead(t, r, few.String(), 0, 0)
	require.Equal(t, http.StatusRequestHeaderFieldsTooLarge, code, "one field past the count bound, few bytes")

	grew := rssBytes(t) - before
	require.Less(t, grew, int64(64<<20), "the service's RSS grew by %d MiB", grew>>20)
	require.InDelta(t, 1.0, decisions(egress.Denied, egress.ReasonRequestLineTooLong), 0)
	require.InDelta(t, 3.0, decisions(egress.Denied, egress.ReasonHeadersTooLarge), 0)

	// A head within the bounds still passes.
	status, body, err := get(t, r.client(""), r.url(r.plain, "http", "allowed.test"))
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status, body)
}
