package server

import (
	"testing"

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
