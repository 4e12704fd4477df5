package server

import (
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/config"
)

func TestParsePool(t *testing.T) {
	t.Parallel()
	got, err := ParsePool(" opencode=2, kilo=0,scripted=1 ")
	require.NoError(t, err)
	require.Equal(t, map[string]int{"opencode": 2, "kilo": 0, "scripted": 1}, got)
	got, err = ParsePool("")
	require.NoError(t, err)
	require.Empty(t, got)
	for _, bad := range []string{"opencode", "=2", "opencode=-1", "opencode=65", "opencode=two", "opencode=1,opencode=2"} {
		_, err := ParsePool(bad)
		require.Error(t, err, bad)
	}
}

// TestPoolSettingsValidated: a pool of a profile no configuration has, and
// a pool directory that is not a clean absolute path, are refused at start
// naming the variable; a configured profile that is not installed is not
// (the pool reports it at start and stays empty).
func TestPoolSettingsValidated(t *testing.T) {
	t.Parallel()
	load := func(kv ...string) error {
		env := map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1", "AGENTPLANE_AGENTS_DIR": t.TempDir()}
		for i := 0; i+1 < len(kv); i += 2 {
			env[config.EnvPrefix+kv[i]] = kv[i+1]
		}
		_, err := LoadConfig(nil, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		return err
	}
	require.NoError(t, load("SANDBOX_POOL", "opencode=2,scripted=1"))
	err := load("SANDBOX_POOL", "opencod=2")
	require.ErrorContains(t, err, "SANDBOX_POOL")
	require.ErrorContains(t, err, `no agent profile "opencod"`)
	require.ErrorContains(t, load("SANDBOX_POOL", "opencode=x"), "SANDBOX_POOL")
	require.ErrorContains(t, load("SANDBOX_POOL_DIRECTORY", "work"), "SANDBOX_POOL_DIRECTORY")
	require.ErrorContains(t, load("SANDBOX_POOL_DIRECTORY", "/work/../x"), "SANDBOX_POOL_DIRECTORY")
}
