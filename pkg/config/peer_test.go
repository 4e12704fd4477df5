package config

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCheckPeerAddr(t *testing.T) {
	for _, ok := range []string{"h:1", "a:1,b:2", "dns:///sandbox-headless.ns.svc:7402", "unix:///run/s.sock"} {
		require.NoError(t, CheckPeerAddr("SANDBOX_ADDR", ok, true), ok)
	}
	require.NoError(t, CheckPeerAddr("INGEST_ADDR", "", false))
	err := CheckPeerAddr("SANDBOX_ADDR", "", true)
	require.ErrorContains(t, err, "AGENTPLANE_SANDBOX_ADDR (--sandbox-addr): required")
	err = CheckPeerAddr("SANDBOX_ADDR", "a:1:2", true)
	require.ErrorContains(t, err, "AGENTPLANE_SANDBOX_ADDR (--sandbox-addr)")
	var cfgErr *Error
	require.ErrorAs(t, err, &cfgErr)
}
