package config_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/storeerr"
)

// A Cluster client from config.Redis follows a killed master's promoted
// replica without waiting for its periodic slot map reload: the test sets
// that reload to 10 minutes, so only the reload on connection errors can
// make the key's slot serve again within the test's bound.
func TestClusterClientFollowsPromotionAtOnce(t *testing.T) {
	c := redistest.StartCluster(t)
	rdb, err := config.Redis(c.URL() + "?cluster_reload_interval=10m")
	require.NoError(t, err)
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := t.Context()
	const key = "{failover}k"
	require.NoError(t, rdb.Set(ctx, key, "before", 0).Err())

	master, err := c.MasterOf(ctx, key)
	require.NoError(t, err)
	// WAIT on the key's own master (through rdb it reaches any node).
	require.Equal(t, int64(1), master.Client(t).Do(ctx, "WAIT", 1, 5000).Val(), "the write reached the replica")
	require.NoError(t, master.Kill())
	killed := time.Now()

	// Calls fail while the replica is not yet promoted; each failure is
	// store-unavailable, never anything else.
	var promoted time.Duration
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		if c.WaitHealthy(wctx) == nil {
			promoted = time.Since(killed)
		}
	}()
	deadline := killed.Add(60 * time.Second)
	failures := 0
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		err := rdb.Set(cctx, key, "after", 0).Err()
		cancel()
		if err == nil {
			break
		}
		failures++
		require.True(t, storeerr.Unavailable(err) || errors.Is(err, context.DeadlineExceeded), "failover error %v", err)
		require.True(t, time.Now().Before(deadline), "the key's slot never served again: %v", err)
		time.Sleep(20 * time.Millisecond)
	}
	served := time.Since(killed)
	t.Logf("kill -9 of the master: slot served again after %v (%d failed calls); cluster reported healthy after %v", served, failures, promoted)
	require.Positive(t, failures, "the kill was noticed")
	require.Equal(t, "after", rdb.Get(ctx, key).Val())
}

func TestClusterReloadIntervalOption(t *testing.T) {
	_, err := config.Redis("redis+cluster://127.0.0.1:1?cluster_reload_interval=nope")
	require.ErrorContains(t, err, "cluster_reload_interval")
	_, err = config.Redis("redis+cluster://127.0.0.1:1?cluster_reload_interval=0s")
	require.ErrorContains(t, err, "cluster_reload_interval")
	rdb, err := config.Redis("redis+cluster://127.0.0.1:1,127.0.0.1:2?cluster_reload_interval=2s&dial_timeout=1s")
	require.NoError(t, err)
	require.NoError(t, rdb.Close())
}

// A Sentinel client from config.Redis follows a planned SENTINEL FAILOVER:
// writes land on the promoted replica, and every failed write in between
// is store-unavailable.
func TestSentinelClientFollowsFailover(t *testing.T) {
	g := redistest.StartSentinel(t)
	rdb, err := config.Redis(g.URL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := t.Context()
	require.NoError(t, rdb.Set(ctx, "k", "0", 0).Err())
	require.NoError(t, g.Failover(ctx))
	started := time.Now()
	deadline := started.Add(60 * time.Second)
	failures := 0
	for i := 1; ; i++ {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		err := rdb.Set(cctx, "k", i, 0).Err()
		cancel()
		if err != nil {
			failures++
			require.True(t, storeerr.Unavailable(err) || errors.Is(err, context.DeadlineExceeded), "failover error %v", err)
		}
		if addr, _ := g.MasterAddr(ctx); addr == g.Replica.Addr() && err == nil {
			// Written after the switch: it must be on the new master.
			direct := redis.NewClient(g.Replica.Options())
			v, gerr := direct.Get(ctx, "k").Int()
			_ = direct.Close()
			require.NoError(t, gerr)
			if v == i {
				break
			}
		}
		require.True(t, time.Now().Before(deadline), "writes never reached the promoted replica (last error %v)", err)
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("planned failover: writes on the new master %v after SENTINEL FAILOVER (%d failed writes)", time.Since(started), failures)
}
