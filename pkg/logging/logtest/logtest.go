// Package logtest gives tests a logger that writes through t.Output(), so log lines appear
// with the test that produced them (and only when it fails or runs with -v).
package logtest

import (
	"log/slog"
	"testing"

	"agentplane.dev/pkg/logging"
)

// New returns a debug-level text logger writing to t.Output(), with trace ids.
func New(t testing.TB) *slog.Logger {
	return logging.New(t.Output(), logging.Text, slog.LevelDebug)
}
