package lease

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestDecodeQuarantinesGarbage(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{"", "{", "null", `{"state":"sleeping"}`, `{"state":"owns_wrapper","next_generation":1}`,
		`{"state":"stopping","next_generation":1}`, `{"state":"none","attempts":-1}`, `[]`} {
		l, err := Decode([]byte(raw), t0)
		require.Error(t, err, raw)
		require.Equal(t, StopNeeded, l.State, "never none: %q", raw)
		require.True(t, l.Exhausted)
		require.True(t, l.HoldsDelivery())
		require.Greater(t, l.NextGeneration, uint64(1_000_000))
	}
	l, err := Decode([]byte(`{"state":"none","next_generation":5}`), t0)
	require.NoError(t, err)
	require.Equal(t, Lease{State: None, NextGeneration: 5}, l)
}

func FuzzDecode(f *testing.F) {
	for _, s := range []string{`{"state":"none"}`, `{"state":"owns_wrapper","instance":"i","generation":1,"next_generation":2}`, "{", ""} {
		f.Add([]byte(s))
	}
	now := time.Unix(1_800_000_000, 0)
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := Decode(b, now)
		if err != nil {
			if l.State != StopNeeded || !l.Exhausted {
				t.Fatalf("unparseable lease not quarantined: %+v", l)
			}
			return
		}
		if _, err := Encode(l); err != nil {
			t.Fatal(err)
		}
	})
}
