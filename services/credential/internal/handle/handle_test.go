package handle

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNewParseRoundTrip(t *testing.T) {
	for _, k := range []Kind{Worktree, PerSession} {
		h, err := New(k)
		require.NoError(t, err)
		require.Len(t, h, Len)
		require.True(t, strings.HasPrefix(h, k.Prefix()))
		got, err := Parse(h)
		require.NoError(t, err)
		require.Equal(t, k, got)
	}
}

func TestParseRejects(t *testing.T) {
	h, err := New(Worktree)
	require.NoError(t, err)
	flip := func(i int) string {
		b := []byte(h)
		if b[i] == 'A' {
			b[i] = 'B'
		} else {
			b[i] = 'A'
		}
		return string(b)
	}
	cases := map[string]string{
		"empty":          "",
		"short":          h[:Len-1],
		"long":           h + "A",
		"bad prefix":     "apx_" + h[4:],
		"body changed":   flip(10),
		"sum changed":    flip(Len - 1),
		"bad alphabet":   h[:10] + "+" + h[11:],
		"kind swapped":   "aps_" + h[4:],
		"bearer in body": "Bearer " + h[:Len-7],
	}
	for name, in := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Parse(in)
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}

func TestDigest(t *testing.T) {
	a, _ := New(Worktree)
	b, _ := New(Worktree)
	da, db := DigestOf(a), DigestOf(b)
	require.True(t, da.Equal(DigestOf(a)))
	require.False(t, da.Equal(db))
	back, err := ParseDigest(da.String())
	require.NoError(t, err)
	require.True(t, back.Equal(da))
	require.NotContains(t, da.String(), a)
	_, err = ParseDigest("zz")
	require.Error(t, err)
}

func FuzzParse(f *testing.F) {
	h, _ := New(Worktree)
	p, _ := New(PerSession)
	for _, s := range []string{"", h, p, h[:Len-1] + "A", "aph_" + strings.Repeat("A", 49), strings.Repeat("\x00", Len)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k, err := Parse(s)
		if err != nil {
			return
		}
		// Anything accepted has the exact shape and re-checks the same.
		if len(s) != Len || !strings.HasPrefix(s, k.Prefix()) {
			t.Fatalf("accepted a handle of the wrong shape")
		}
		if s[:Len-sumLen]+checksum(s[:Len-sumLen]) != s {
			t.Fatalf("accepted a bad checksum")
		}
	})
}
