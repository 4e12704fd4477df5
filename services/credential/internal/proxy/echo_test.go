package proxy

import (
	"bytes"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// scrub runs body through a scrubber in chunks of the given sizes (the
// last one repeated) and returns what would be sent.
func scrub(g echoGuard, body string, sizes ...int) string {
	s := scrubber{g: g}
	var out bytes.Buffer
	for i := 0; len(body) > 0; i++ {
		n := min(sizes[min(i, len(sizes)-1)], len(body))
		out.Write(s.next([]byte(body[:n]), n == len(body)))
		body = body[n:]
	}
	out.Write(s.next(nil, true))
	return out.String()
}

func TestScrubberMasksAcrossChunks(t *testing.T) {
	g := newEchoGuard("sk-secret-1", "v1.att.sig")
	body := "Authorization: Bearer sk-secret-1\r\nX-Att: v1.att.sig\r\nsk-secre and sk-secret-1sk-secret-1 v1.att"
	want := "Authorization: Bearer ***********\r\nX-Att: **********\r\nsk-secre and ********************** v1.att"
	for _, sizes := range [][]int{{len(body)}, {1}, {2}, {3}, {5}, {7, 1}, {11}, {33, 2}} {
		require.Equal(t, want, scrub(g, body, sizes...), "chunks %v", sizes)
	}
	// A needle that only completes where the stream ends is still masked;
	// a prefix at the very end is sent as it is (nothing can complete it).
	require.Equal(t, "x***********", scrub(g, "xsk-secret-1", 4))
	require.Equal(t, "xsk-secret-", scrub(g, "xsk-secret-", 4))
}

func TestScrubberHoldsBackOnlyWhatCouldStartANeedle(t *testing.T) {
	s := scrubber{g: newEchoGuard("abcdef")}
	require.Equal(t, "data: x\n\n", string(s.next([]byte("data: x\n\n"), false)), "an event goes out whole at once")
	require.Equal(t, "data: ", string(s.next([]byte("data: abc"), false)))
	require.Equal(t, "abcxyz", string(s.next([]byte("xyz"), false)), "released once it cannot be the needle")
}

// Masking one needle may write '*' where another needle has one: the loop
// runs until no needle is left.
func TestMaskOverlappingNeedles(t *testing.T) {
	b := []byte("xzy-zz")
	mask(b, [][]byte{[]byte("x*y"), []byte("z")})
	require.Equal(t, "***-**", string(b))
	g := newEchoGuard("***", "")
	require.Empty(t, g.needles, "an all-'*' or empty value is never a needle")
}

func TestEchoGuardHeaders(t *testing.T) {
	g := newEchoGuard("sk-1")
	require.False(t, g.inHeader(http.Header{"X-A": {"fine"}}))
	require.True(t, g.inHeader(http.Header{"X-A": {"fine", "Bearer sk-1"}}))
	require.True(t, g.inHeader(http.Header{"X-sk-1": {"v"}}), "in a name too")
}

func FuzzScrubber(f *testing.F) {
	f.Add("sk-secret", "Bearer sk-secret end", uint8(3))
	f.Add("aa", "aaaaa", uint8(1))
	f.Add("abab", "abababab", uint8(2))
	f.Fuzz(func(t *testing.T, needle, body string, chunk uint8) {
		g := newEchoGuard(needle)
		got := scrub(g, body, int(chunk)+1)
		require.Len(t, got, len(body), "same length")
		if len(g.needles) > 0 {
			require.NotContains(t, got, needle)
		}
		for i := range got { // only masks, nothing else changes
			if got[i] != body[i] {
				require.Equal(t, byte('*'), got[i])
			}
		}
		if !strings.Contains(body, needle) || len(g.needles) == 0 {
			require.Equal(t, body, got)
		}
	})
}
