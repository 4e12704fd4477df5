package config_test

import (
	"flag"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/redistest"
)

func load(t *testing.T, env map[string]string, args ...string) (config.Common, error) {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c := config.DefaultCommon("127.0.0.1:7401", "127.0.0.1:9401")
	l := config.NewLoader(fs, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	c.Bind(l)
	if err := l.Parse(args); err != nil {
		return c, err
	}
	return c, c.Validate()
}

func TestDefaultsEnvAndFlags(t *testing.T) {
	c, err := load(t, map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1/0"})
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:7401", c.GRPCAddr)
	require.Equal(t, 5*time.Second, c.DrainDelay)
	require.Equal(t, 20*time.Second, c.ShutdownTimeout)
	require.Equal(t, slog.LevelInfo, c.LogLevel)
	require.Equal(t, "json", c.LogFormat)

	c, err = load(t, map[string]string{
		"AGENTPLANE_REDIS_URL":        "redis://127.0.0.1:1/0",
		"AGENTPLANE_DRAIN_DELAY":      "1s",
		"AGENTPLANE_LOG_LEVEL":        "debug",
		"AGENTPLANE_INTERNAL_TOKEN":   "from-env",
		"AGENTPLANE_SHUTDOWN_TIMEOUT": "3s",
	}, "--drain-delay=0s", "--internal-token=from-flag")
	require.NoError(t, err)
	require.Equal(t, time.Duration(0), c.DrainDelay, "flag wins over env")
	require.Equal(t, 3*time.Second, c.ShutdownTimeout, "env sets the default")
	require.Equal(t, slog.LevelDebug, c.LogLevel)
	require.Equal(t, "from-flag", c.InternalToken)
}

// An argument that is not a flag is an error, not the end of the flags.
func TestStrayArgument(t *testing.T) {
	env := map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1/0"}
	_, err := load(t, env, "help")
	require.EqualError(t, err, `unexpected argument "help" (a service takes only flags)`)
	_, err = load(t, env, "--drain-delay=1s", "stray", "--log-level=debug")
	require.ErrorContains(t, err, `unexpected argument "stray"`)
}

func TestErrorsNameVariableAndFlag(t *testing.T) {
	_, err := load(t, map[string]string{"AGENTPLANE_DRAIN_DELAY": "soon", "AGENTPLANE_LOG_LEVEL": "loud"})
	require.ErrorContains(t, err, `AGENTPLANE_DRAIN_DELAY (--drain-delay): invalid value "soon"`)
	require.ErrorContains(t, err, "AGENTPLANE_LOG_LEVEL (--log-level)")

	// A bad env value does not matter when the flag is given.
	_, err = load(t, map[string]string{"AGENTPLANE_DRAIN_DELAY": "soon", "AGENTPLANE_REDIS_URL": "redis://h:1"}, "--drain-delay=2s")
	require.NoError(t, err)

	_, err = load(t, map[string]string{"AGENTPLANE_LOG_FORMAT": "xml", "AGENTPLANE_GRPC_ADDR": "nohostport", "AGENTPLANE_SHUTDOWN_TIMEOUT": "0s"})
	require.ErrorContains(t, err, "AGENTPLANE_REDIS_URL (--redis-url): required")
	require.ErrorContains(t, err, "AGENTPLANE_GRPC_ADDR (--grpc-addr): want host:port")
	require.ErrorContains(t, err, "AGENTPLANE_LOG_FORMAT (--log-format)")
	require.ErrorContains(t, err, "AGENTPLANE_SHUTDOWN_TIMEOUT (--shutdown-timeout): must be positive")
	var ce *config.Error
	require.ErrorAs(t, err, &ce)

	_, err = load(t, map[string]string{"AGENTPLANE_REDIS_URL": "memcached://x"})
	require.ErrorContains(t, err, `AGENTPLANE_REDIS_URL (--redis-url): unsupported scheme "memcached"`)
}

func TestRedisSingleNodeTalksToRealServer(t *testing.T) {
	for _, opts := range [][]redistest.Option{nil, {redistest.WithUnixSocket()}} {
		srv := redistest.Start(t, opts...)
		rdb, err := config.Redis(srv.URL())
		require.NoError(t, err)
		require.NoError(t, rdb.Ping(t.Context()).Err(), srv.URL())
		require.NoError(t, rdb.Close())
	}
}

func TestRedisSentinelAndCluster(t *testing.T) {
	rdb, err := config.Redis("redis+sentinel://:secret@10.0.0.1:26379,10.0.0.2:26379/mymaster/2?dial_timeout=2s")
	require.NoError(t, err)
	c, ok := rdb.(*redis.Client)
	require.True(t, ok)
	require.Equal(t, 2, c.Options().DB)
	require.Equal(t, "secret", c.Options().Password)
	require.Equal(t, 2*time.Second, c.Options().DialTimeout)
	require.NoError(t, rdb.Close())

	rdb, err = config.Redis("rediss+cluster://u:p@h1:7000,h2:7001,h3:7002?max_redirects=4")
	require.NoError(t, err)
	cc, ok := rdb.(*redis.ClusterClient)
	require.True(t, ok)
	require.Equal(t, []string{"h1:7000", "h2:7001", "h3:7002"}, cc.Options().Addrs)
	require.Equal(t, "p", cc.Options().Password)
	require.NotNil(t, cc.Options().TLSConfig)
	require.Equal(t, 4, cc.Options().MaxRedirects)
	require.NoError(t, rdb.Close())

	for _, bad := range []string{
		"redis+sentinel://h1:1,h2:2",      // no master name
		"redis+cluster://h1:1,h2:2/3",     // cluster has no db
		"redis+cluster://",                // no host
		"redis+sentinel://h1:1/m?bogus=1", // unknown option
		"localhost:6379",                  // not a URL
	} {
		_, err := config.Redis(bad)
		require.Error(t, err, bad)
	}
}
