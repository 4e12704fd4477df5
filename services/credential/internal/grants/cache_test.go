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
	c := resolutionCache{m: map[handle.Digest]*cached{}, window: 25 * time.Millisecond}
	t0 := time.Now()
	for i := range 100 {
		c.put(handle.DigestOf(fmt.Sprint("old", i)), &cached{verified: t0})
	}
	c.put(handle.DigestOf("fresh"), &cached{verified: t0.Add(sweepEvery - time.Millisecond)})
	require.Len(t, c.m, 101, "no sweep before sweepEvery")

	c.put(handle.DigestOf("new"), &cached{verified: t0.Add(sweepEvery)})
	require.Nil(t, c.get(handle.DigestOf("old0")))
	require.NotNil(t, c.get(handle.DigestOf("fresh")), "within the window of the sweep")
	require.NotNil(t, c.get(handle.DigestOf("new")))
	require.Len(t, c.m, 2)
}
