package server

import (
	"encoding/base64"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/config"
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

// TestKeysFromFiles: both keys are secret settings with a file form; a bad key read from a
// file is reported by the file's variable, without its content.
func TestKeysFromFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, v string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(v), 0o600))
		return p
	}
	credKey := base64.StdEncoding.EncodeToString(make([]byte, 32))
	attKey := base64.StdEncoding.EncodeToString([]byte("an-attestation-key-of-32-bytes!!"))
	env := map[string]string{
		"AGENTPLANE_REDIS_URL":            "redis://127.0.0.1:1",
		"AGENTPLANE_CREDENTIAL_KEY_FILE":  write("cred", credKey+"\n"),
		"AGENTPLANE_ATTESTATION_KEY_FILE": write("att", attKey+"\n"),
	}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	cfg, err := LoadConfig(nil, lookup)
	require.NoError(t, err)
	require.Equal(t, credKey, cfg.CredentialKey)
	require.Equal(t, attKey, cfg.AttestationKey)
	require.Empty(t, cfg.PlainSecrets())

	env["AGENTPLANE_CREDENTIAL_KEY_FILE"] = write("short", "c2hvcnQ=\n")
	_, err = LoadConfig(nil, lookup)
	require.ErrorContains(t, err, "AGENTPLANE_CREDENTIAL_KEY (--credential-key): key is 5 bytes, want 32")
	require.NotContains(t, err.Error(), "c2hvcnQ=")

	delete(env, "AGENTPLANE_CREDENTIAL_KEY_FILE")
	env["AGENTPLANE_CREDENTIAL_KEY"] = credKey
	cfg, err = LoadConfig(nil, lookup)
	require.NoError(t, err, "the environment form still works")
	require.Equal(t, []config.PlainSecret{{Name: "CREDENTIAL_KEY"}}, cfg.PlainSecrets())
}

// The proxy's allowlists are validated at start: a method that echoes or
// tunnels, a header the proxy always strips, or a malformed name fails
// fast with the setting's name.
func TestLoadConfigProxyAllowlists(t *testing.T) {
	for name, bad := range map[string]string{
		"AGENTPLANE_PROXY_PROVIDER_METHODS":     "GET,TRACE",
		"AGENTPLANE_PROXY_BACKEND_METHODS":      "get",
		"AGENTPLANE_PROXY_PROVIDER_HEADERS":     "Accept,Authorization",
		"AGENTPLANE_PROXY_BACKEND_HEADERS":      "X-Forwarded-*",
		"AGENTPLANE_PROXY_GIT_PRIVATE_NETWORKS": "git.internal",
	} {
		env := map[string]string{"AGENTPLANE_REDIS_URL": "redis://127.0.0.1:1", name: bad}
		_, err := LoadConfig(nil, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		require.ErrorContains(t, err, name, bad)
	}
	for _, bad := range []string{"CONNECT", "", "G ET"} {
		_, err := LoadConfig([]string{"-redis-url", "redis://127.0.0.1:1", "-proxy-backend-methods", bad}, func(string) (string, bool) { return "", false })
		require.ErrorContains(t, err, "AGENTPLANE_PROXY_BACKEND_METHODS", bad)
	}
	_, err := LoadConfig([]string{"-redis-url", "redis://127.0.0.1:1", "-proxy-provider-headers", "Bad Header"}, func(string) (string, bool) { return "", false })
	require.ErrorContains(t, err, "AGENTPLANE_PROXY_PROVIDER_HEADERS")

	cfg, err := LoadConfig([]string{"-redis-url", "redis://127.0.0.1:1", "-proxy-backend-methods", "GET,OPTIONS", "-proxy-backend-headers", "Accept,X-Custom-*"},
		func(string) (string, bool) { return "", false })
	require.NoError(t, err)
	_, backend, err := cfg.policies()
	require.NoError(t, err)
	require.Equal(t, []string{"GET", "OPTIONS"}, backend.Methods)
	require.Equal(t, []string{"Accept", "X-Custom-*"}, backend.Headers)
	nets, err := cfg.gitNetworks()
	require.NoError(t, err)
	require.Empty(t, nets, "the git route dials no private address by default")
	cfg, err = LoadConfig([]string{"-redis-url", "redis://127.0.0.1:1", "-proxy-git-private-networks", "10.0.0.0/8, 127.0.0.1"},
		func(string) (string, bool) { return "", false })
	require.NoError(t, err)
	nets, err = cfg.gitNetworks()
	require.NoError(t, err)
	require.Equal(t, []string{"10.0.0.0/8", "127.0.0.1"}, nets)
}
