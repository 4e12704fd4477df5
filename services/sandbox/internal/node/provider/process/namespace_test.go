package process

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

func plainProvider(t *testing.T, log *slog.Logger) *Provider {
	t.Helper()
	p, err := New(Config{Root: t.TempDir(), Logger: log})
	require.NoError(t, err)
	return p
}

// Issue 33 item 6: a namespace record that cannot be written is logged,
// not skipped in silence.
func TestUnwrittenNamespaceRecordIsLogged(t *testing.T) {
	var buf bytes.Buffer
	p := plainProvider(t, slog.New(slog.NewTextHandler(&buf, nil)))
	require.NoError(t, p.Create(context.Background(), "sb"))
	// run/ cannot be made: a file is where the directory goes.
	require.NoError(t, os.WriteFile(p.runDir("sb"), nil, 0o644))
	m := provider.Markers{SandboxID: "sb", RuntimeKey: "/k", InstanceID: "inst-1", Generation: 1}
	require.Empty(t, p.recordNamespace(m, "k", os.Getpid(), os.Getpid()))
	require.Contains(t, buf.String(), "namespace record not written")
	require.Contains(t, buf.String(), "instance=inst-1")

	buf.Reset()
	require.NoError(t, os.Remove(p.runDir("sb")))
	path := p.recordNamespace(m, "k", os.Getpid(), os.Getpid())
	require.FileExists(t, path)
	require.Empty(t, buf.String())
}
