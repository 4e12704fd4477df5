package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/ownership"
	"agentplane.dev/services/sandbox/server"
)

// A replica that stops gracefully gives its sandboxes up before it closes
// Redis, so another replica can take them over at once rather than after
// the owner TTL. (The driver's loop used to stop after Redis was closed:
// its releases failed with "client is closed" and the leases stayed.)
func TestGracefulStopReleasesOwnership(t *testing.T) {
	n := startNotify(t)
	svc, stop := startStoppableService(t, context.Background(), n.addr, func(c *server.Config) {
		c.OwnerTTL = time.Minute // a lease left behind would outlive the test
	})
	sb := uniqueSandbox(t)
	waitReady(t, svc, n, 0, route(sb, "s1", "/repo/rel"))
	rdb := redisSrv.Client(t)
	owner, _, err := ownership.Current(context.Background(), rdb, sb)
	require.NoError(t, err)
	require.NotEmpty(t, owner, "the replica owns the sandbox it prepared")

	stop()
	owner, _, err = ownership.Current(context.Background(), rdb, sb)
	require.NoError(t, err)
	require.Empty(t, owner, "a gracefully stopped replica released its sandbox")
}
