// Package logtest gives tests a logger that writes through t.Output(), so log lines appear
// with the test that produced them (and only when it fails or runs with -v).
package logtest

import (
	"bytes"
	"log/slog"
	"sync"
	"testing"

	"agentplane.dev/pkg/logging"
)

// New returns a debug-level text logger writing to t.Output(), with trace ids.
func New(t testing.TB) *slog.Logger {
	return logging.New(t.Output(), logging.Text, slog.LevelDebug)
}

// Buffer collects log lines or a child's stderr from several goroutines, so
// a test can read them while writers still run (e.g. to check that no
// secret ever reached them).
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
