package server

import (
	"maps"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func lookup(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

// Peer addresses take every form users write: host:port, a list, dns:///.
func TestPeerAddressForms(t *testing.T) {
	base := map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1/0"}
	for _, v := range []string{"sandbox:7402", "10.0.0.1:7402,10.0.0.2:7402", "dns:///ap-sandbox-headless.agentplane.svc:7402"} {
		e := map[string]string{"AGENTPLANE_SANDBOX_ADDR": v, "AGENTPLANE_INGEST_ADDR": v, "AGENTPLANE_CREDENTIAL_ADDR": v}
		for k, x := range base {
			e[k] = x
		}
		c, err := LoadConfig(nil, lookup(e))
		require.NoError(t, err, v)
		require.Equal(t, v, c.SandboxAddr)
	}
	_, err := LoadConfig([]string{"--sandbox-addr", "a:1,,b:2"}, lookup(base))
	require.ErrorContains(t, err, "AGENTPLANE_SANDBOX_ADDR (--sandbox-addr): empty entry")
}

// suspend_after's default is 2 min, 0 turns it off, and a profile may
// override it; a bad value names its variable.
func TestSuspendAfterSettings(t *testing.T) {
	base := map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1/0"}
	c, err := LoadConfig(nil, lookup(base))
	require.NoError(t, err)
	p := c.SuspendPolicy()
	require.Equal(t, 2*time.Minute, p.Default)
	require.Empty(t, p.Profiles)

	e := map[string]string{"AGENTPLANE_SESSION_SUSPEND_AFTER": "0", "AGENTPLANE_SESSION_SUSPEND_AFTER_PROFILES": "opencode=5m,kilo=0"}
	maps.Copy(e, base)
	c, err = LoadConfig(nil, lookup(e))
	require.NoError(t, err)
	p = c.SuspendPolicy()
	require.Equal(t, time.Duration(0), p.Default)
	require.Equal(t, map[string]time.Duration{"opencode": 5 * time.Minute, "kilo": 0}, p.Profiles)

	for k, v := range map[string]string{
		"AGENTPLANE_SESSION_SUSPEND_AFTER":          "-1s",
		"AGENTPLANE_SESSION_SUSPEND_AFTER_PROFILES": "opencode",
	} {
		e := map[string]string{k: v}
		maps.Copy(e, base)
		_, err := LoadConfig(nil, lookup(e))
		require.ErrorContains(t, err, k, v)
	}
	e = map[string]string{"AGENTPLANE_SESSION_SUSPEND_AFTER": "100ms"}
	maps.Copy(e, base)
	_, err = LoadConfig(nil, lookup(e))
	require.ErrorContains(t, err, "AGENTPLANE_SESSION_SUSPEND_AFTER")
}
