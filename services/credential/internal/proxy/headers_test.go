package proxy

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

// The filters run on every proxied request: they must not allocate for a
// usual header set (names lower-cased in a stack buffer).
func TestFiltersDoNotAllocate(t *testing.T) {
	req := http.Header{"Content-Type": {"application/json"}, "Accept": {"*/*"}, "User-Agent": {"runtime/1"},
		"Content-Length": {"85"}, "Openai-Beta": {"assistants=v2"}, "X-Stainless-Lang": {"js"}}
	require.Zero(t, testing.AllocsPerRun(100, func() { FilterRequest(req) }))
	require.Len(t, req, 6, "nothing to remove")
	resp := http.Header{"Content-Type": {"application/json"}, "Date": {"Mon"}, "X-Request-Id": {"r1"}, "Openai-Processing-Ms": {"12"}}
	require.Zero(t, testing.AllocsPerRun(100, func() { FilterResponse(resp) }))
	require.Len(t, resp, 4)

	h := http.Header{"X-VERY-LONG-HEADER-NAME-THAT-DOES-NOT-FIT-THE-STACK-BUFFER-API-KEY-SUFFIX": {"k"}, "connection": {"X-Hop"}, "x-hop": {"1"}}
	FilterRequest(h)
	require.Empty(t, h, "long names and Connection-named headers are still matched")
}
