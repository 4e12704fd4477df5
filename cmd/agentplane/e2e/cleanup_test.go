package e2e

import (
	"testing"
	"time"

	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"

	"github.com/stretchr/testify/require"
)

// killProcessesUnder registers a cleanup that kills every process still
// running under root and waits until none is left. By design a wrapper
// outlives its sandbox service (it reconnects for the reconnect window), so
// a test that stops the services must stop the wrappers itself: a wrapper
// left behind keeps running after the test and, since discovery reads
// /proc, the next suite that uses the same sandbox id sees it as a leaked
// wrapper of its own runtime key and stops that key.
//
// Register it before the services start: cleanups run last-in first-out,
// so it runs after the services stopped and cannot relaunch anything.
func killProcessesUnder(t testing.TB, root string) {
	t.Cleanup(func() {
		left := sandboxprocs.Stop(root, 0, 30*time.Second)
		require.Empty(t, left, "processes under %s survived SIGKILL", root)
	})
}
