package server

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestLoadConfigNamesBadSettings(t *testing.T) {
	env := map[string]string{
		"AGENTPLANE_REDIS_URL":               "redis://127.0.0.1:1",
		"AGENTPLANE_CREDENTIAL_KEY":          "c2hvcnQ=",
		"AGENTPLANE_ATTESTATION_KEY":         "c2hvcnQ=",
		"AGENTPLANE_PROVIDER_UPSTREAM":       "ftp://x",
		"AGENTPLANE_PROXY_ADDR":              "nope",
		"AGENTPLANE_GRANT_TTL":               "0s",
		"AGENTPLANE_RESOLUTION_TRUST_WINDOW": "5s",
	}
	_, err := LoadConfig(nil, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.Error(t, err)
	for _, name := range []string{"AGENTPLANE_CREDENTIAL_KEY", "AGENTPLANE_ATTESTATION_KEY", "AGENTPLANE_PROVIDER_UPSTREAM", "AGENTPLANE_PROXY_ADDR", "AGENTPLANE_GRANT_TTL", "AGENTPLANE_RESOLUTION_TRUST_WINDOW"} {
		require.Contains(t, err.Error(), name)
	}
	require.NotContains(t, err.Error(), "c2hvcnQ=", "key values are not echoed")

	cfg, err := LoadConfig([]string{"-redis-url", "redis://127.0.0.1:1"}, func(string) (string, bool) { return "", false })
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:7405", cfg.ProxyAddr)
	require.Equal(t, DefaultConfig().GrantTTL, cfg.GrantTTL)
}
