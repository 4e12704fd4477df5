package main

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"agentplane.dev/cmd/agentplane/internal/cli"
)

// devConn dials the agentplane dev suite whose service listens on addr,
// carrying dev's internal token (every call needs it) as the CLI does: read
// from dev's state file at each call, since the suite may not have written
// it yet when the test dials.
func devConn(t *testing.T, addr string, sessionAddr string) *grpc.ClientConn {
	t.Helper()
	_, port, err := net.SplitHostPort(sessionAddr)
	require.NoError(t, err)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(devToken{path: cli.DevStatePath(port)}))
	require.NoError(t, err)
	return conn
}

// devToken is dev's internal token as per-call credentials.
type devToken struct{ path string }

func (d devToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	b, err := os.ReadFile(d.path)
	if err != nil {
		return nil, nil // not written yet: the call goes without (health needs none)
	}
	var st cli.DevState
	if err := json.Unmarshal(b, &st); err != nil || st.InternalToken == "" {
		return nil, nil
	}
	return map[string]string{"authorization": "Bearer " + st.InternalToken}, nil
}

func (devToken) RequireTransportSecurity() bool { return false }
