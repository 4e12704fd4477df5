package storeerr_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/storeerr"
)

// The errors a real go-redis client returns while the real redis-server is
// down, closed or loading read as unavailable, wrapped or not; a missing
// key, a script error or a cancelled call do not.
func TestUnavailableOnRealOutages(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	require.NoError(t, rdb.Set(ctx, "k", "v", 0).Err())

	err := rdb.Get(ctx, "missing").Err()
	require.ErrorIs(t, err, redis.Nil)
	require.False(t, storeerr.Unavailable(err), "redis.Nil")
	err = rdb.Eval(ctx, "return redis.error_reply('FENCE_STALE')", nil).Err()
	require.Error(t, err)
	require.False(t, storeerr.Unavailable(err), "a script's error reply")
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	require.False(t, storeerr.Unavailable(rdb.Get(cctx, "k").Err()), "a cancelled call")

	require.NoError(t, srv.Kill())
	err = rdb.Get(ctx, "k").Err()
	require.Error(t, err)
	require.True(t, storeerr.Unavailable(err), "server killed: %v", err)
	require.True(t, storeerr.Unavailable(fmt.Errorf("store: load: %w", err)), "wrapped")

	closed := redis.NewClient(srv.Options())
	require.NoError(t, closed.Close())
	require.True(t, storeerr.Unavailable(closed.Get(ctx, "k").Err()), "closed client")

	require.True(t, storeerr.Unavailable(redis.ErrPoolTimeout))
	require.False(t, storeerr.Unavailable(errors.New("boom")))
	require.False(t, storeerr.Unavailable(fmt.Errorf("x: %w", context.DeadlineExceeded)))
	require.False(t, storeerr.Unavailable(nil))
}

// A Cluster node asked for a key of a slot another master serves answers
// MOVED; a single-node client (what a stream watcher uses) returns it to
// the caller, and it reads as unavailable: after a failover the retry finds
// the new master, rather than the call failing as internal.
func TestUnavailableOnMovedFromAClusterNode(t *testing.T) {
	c := redistest.StartCluster(t)
	ctx := context.Background()
	owner, err := c.MasterOf(ctx, "k")
	require.NoError(t, err)
	for _, n := range c.Nodes {
		if n == owner {
			continue
		}
		rc := redis.NewClient(n.Options())
		err := rc.Get(ctx, "k").Err()
		_ = rc.Close()
		require.ErrorContains(t, err, "MOVED")
		require.True(t, storeerr.Unavailable(err), "%v", err)
		return
	}
	t.Fatal("no node other than the slot's master")
}
