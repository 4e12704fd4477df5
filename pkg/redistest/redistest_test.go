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

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

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
