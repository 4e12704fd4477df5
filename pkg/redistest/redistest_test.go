package redistest_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/redistest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(redistest.Shared(m)) }

func TestStartTCP(t *testing.T) {
	srv := redistest.Start(t)
	require.NotContains(t, srv.Addr(), ":6379")
	opt, err := redis.ParseURL(srv.URL())
	require.NoError(t, err)
	c := redis.NewClient(opt)
	defer c.Close()
	ctx := context.Background()
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())
	require.Equal(t, "v", srv.Client(t).Get(ctx, "k").Val())

	cfg := srv.Client(t).ConfigGet(ctx, "*").Val()
	require.Empty(t, cfg["save"], "persistence must be off by default")
	require.Equal(t, "no", cfg["appendonly"])
}

func TestStartUnix(t *testing.T) {
	srv := redistest.Start(t, redistest.WithUnixSocket())
	require.Equal(t, "unix", srv.Network())
	opt, err := redis.ParseURL(srv.URL())
	require.NoError(t, err)
	c := redis.NewClient(opt)
	defer c.Close()
	require.NoError(t, c.Ping(context.Background()).Err())
}

func TestRestartKeepAndDrop(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t) // the same client must work across restarts
	ctx := context.Background()
	addr := srv.Addr()

	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())
	srv.Restart(t, redistest.KeepData)
	require.Equal(t, addr, srv.Addr())
	require.Equal(t, "v", c.Get(ctx, "k").Val())

	srv.Restart(t, redistest.DropData)
	require.ErrorIs(t, c.Get(ctx, "k").Err(), redis.Nil)
	_, err := os.Stat(filepath.Join(srv.Dir(), "dump.rdb"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestKillStopStart(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())

	require.NoError(t, srv.Kill())
	require.False(t, srv.Running())
	require.Error(t, c.Ping(ctx).Err())
	srv.Start(t)
	require.NoError(t, c.Ping(ctx).Err())
	require.ErrorIs(t, c.Get(ctx, "k").Err(), redis.Nil, "kill must not save")

	require.NoError(t, srv.Stop())
	require.False(t, srv.Running())
	srv.Start(t)
	require.True(t, srv.Running())
}

func TestPauseResume(t *testing.T) {
	srv := redistest.Start(t)
	opt := srv.Options()
	opt.ReadTimeout = 100 * time.Millisecond
	opt.MaxRetries = -1
	c := redis.NewClient(opt)
	defer c.Close()
	ctx := context.Background()
	require.NoError(t, c.Ping(ctx).Err())

	require.NoError(t, srv.Pause())
	require.Error(t, c.Ping(ctx).Err(), "a paused server must not answer")
	require.True(t, srv.Running())
	require.NoError(t, srv.Resume())
	require.NoError(t, c.Ping(ctx).Err())
}

func TestMissingBinaryFails(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	_, err := redistest.New(t.TempDir())
	require.ErrorContains(t, err, "apt-get install redis-server")
}

func TestCloseKillsPausedServer(t *testing.T) {
	srv, err := redistest.New(t.TempDir())
	require.NoError(t, err)
	require.NoError(t, srv.Pause())
	require.NoError(t, srv.Close())
	require.False(t, srv.Running())
	require.NoError(t, srv.Close())
}

// A real Cluster: 3 masters with a replica each; a key's master killed with
// -9 is replaced by its replica, and the data written before is there.
func TestClusterFailover(t *testing.T) {
	c := redistest.StartCluster(t)
	require.Len(t, c.Nodes, 6)
	ctx := t.Context()
	cc := c.Client(t)
	require.NoError(t, cc.Set(ctx, "{k}a", "1", 0).Err())
	m, err := c.MasterOf(ctx, "{k}a")
	require.NoError(t, err)
	// WAIT on the key's own master: through the cluster client it goes to
	// any node, which answers 0 at once and the write can die with m.
	require.Equal(t, int64(1), m.Client(t).Do(ctx, "WAIT", 1, 5000).Val(), "the write reached the replica")
	require.NoError(t, m.Kill())
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	require.NoError(t, c.WaitHealthy(wctx))
	m2, err := c.MasterOf(ctx, "{k}a")
	require.NoError(t, err)
	require.NotEqual(t, m.Addr(), m2.Addr())
	// A fresh client (the old one's slot map is the client's business:
	// pkg/config's tests cover following a failover).
	require.Equal(t, "1", c.Client(t).Get(ctx, "{k}a").Val())
}

// A real Sentinel group: a planned failover promotes the replica and a
// failover client follows it.
func TestSentinelFailover(t *testing.T) {
	g := redistest.StartSentinel(t)
	ctx := t.Context()
	c := g.Client(t)
	require.NoError(t, c.Set(ctx, "a", "1", 0).Err())
	require.NoError(t, c.Do(ctx, "WAIT", 1, 5000).Err())
	before, err := g.MasterAddr(ctx)
	require.NoError(t, err)
	require.Equal(t, g.Master.Addr(), before)
	require.NoError(t, g.Failover(ctx))
	require.Eventually(t, func() bool {
		a, err := g.MasterAddr(ctx)
		return err == nil && a == g.Replica.Addr()
	}, 60*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool { return c.Set(ctx, "b", "2", 0).Err() == nil }, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, "1", c.Get(ctx, "a").Val())
}

// Universal follows AGENTPLANE_TEST_REDIS.
func TestUniversalTopologies(t *testing.T) {
	for _, topo := range []string{"single", "cluster", "sentinel"} {
		t.Run(topo, func(t *testing.T) {
			t.Setenv(redistest.EnvTopology, topo)
			c := redistest.Universal(t)
			require.NoError(t, c.Set(t.Context(), "{x}k", topo, 0).Err())
			require.Equal(t, topo, c.Get(t.Context(), "{x}k").Val())
			switch topo {
			case "cluster":
				require.IsType(t, &redis.ClusterClient{}, c)
			default:
				require.IsType(t, &redis.Client{}, c)
			}
			// The next caller gets an empty store.
			require.Zero(t, redistest.Universal(t).Exists(t.Context(), "{x}k").Val())
		})
	}
}
