package server_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/server"
)

// Issue 18 item 3: the capacity threshold and the stale age are settings
// (env and flag), validated at start.
func TestCapacitySettingsAreConfigurableAndValidated(t *testing.T) {
	env := func(kv map[string]string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			if k == "AGENTPLANE_REDIS_URL" {
				return "redis://127.0.0.1:1", true
			}
			v, ok := kv[k]
			return v, ok
		}
	}
	c, err := server.LoadConfig(nil, env(map[string]string{
		"AGENTPLANE_SANDBOX_CAPACITY_THRESHOLD": "5GiB", "AGENTPLANE_SANDBOX_STALE_AGE": "45m"}))
	require.NoError(t, err)
	require.Equal(t, server.ByteSize(5<<30), c.CapacityThreshold)
	require.Equal(t, "45m0s", c.StaleAge.String())

	c, err = server.LoadConfig([]string{"--sandbox-capacity-threshold", "1048576"}, env(nil))
	require.NoError(t, err)
	require.Equal(t, server.ByteSize(1<<20), c.CapacityThreshold)

	c, err = server.LoadConfig(nil, env(nil))
	require.NoError(t, err)
	require.Equal(t, server.ByteSize(2<<30), c.CapacityThreshold, "DESIGN.md default")
	require.Equal(t, "20m0s", c.StaleAge.String(), "DESIGN.md default")

	for k, v := range map[string]string{
		"AGENTPLANE_SANDBOX_CAPACITY_THRESHOLD": "0", "AGENTPLANE_SANDBOX_STALE_AGE": "1s",
	} {
		_, err := server.LoadConfig(nil, env(map[string]string{k: v}))
		require.ErrorContains(t, err, k, "%s=%s must be refused", k, v)
	}
	_, err = server.LoadConfig(nil, env(map[string]string{"AGENTPLANE_SANDBOX_CAPACITY_THRESHOLD": "lots"}))
	require.ErrorContains(t, err, "AGENTPLANE_SANDBOX_CAPACITY_THRESHOLD")
}

// The threshold reaches admission: one larger than any filesystem rejects a
// cold workspace with capacity_rejected (the default admits it).
func TestCapacityThresholdReachesAdmission(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, func(c *server.Config) { c.CapacityThreshold = 1 << 62 })
	sb := uniqueSandbox(t)
	_, err := svc.client.Prepare(t.Context(), route(sb, "s1", "/work/cap"))
	require.NoError(t, err)
	f, _ := n.wait(t, 0, "failed", "s1")
	require.Equal(t, "capacity_rejected", f.Reason)
}
