package grants

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/credential/internal/handle"
)

// Resolutions past the trust window are never used again, so a put drops
// them (at most once per sweepEvery): the cache follows the handles in use,
// not every handle ever resolved.
func TestCacheDropsResolutionsPastTheWindow(t *testing.T) {
	c := newCache(25 * time.Millisecond)
	t0 := time.Now()
	for i := range 100 {
		c.Put(handle.DigestOf(fmt.Sprint("old", i)), &cached{}, t0)
	}
	c.Put(handle.DigestOf("fresh"), &cached{}, t0.Add(sweepEvery-time.Millisecond))
	require.Equal(t, 101, c.Len(), "no sweep before sweepEvery")

	c.Put(handle.DigestOf("new"), &cached{}, t0.Add(sweepEvery))
	_, ok := c.Get(handle.DigestOf("fresh"), t0.Add(sweepEvery))
	require.True(t, ok, "within the window of the sweep")
	_, ok = c.Get(handle.DigestOf("new"), t0.Add(sweepEvery))
	require.True(t, ok)
	require.Equal(t, 2, c.Len(), "the sweep dropped the resolutions past the window")
}
