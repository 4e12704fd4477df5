package process

import (
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The test binary doubles as a wrapper: with HELPER_MODE set it behaves as
// a wrapper-like child instead of running tests.
func TestMain(m *testing.M) {
	switch os.Getenv("HELPER_MODE") {
	case "":
		goleak.VerifyTestMain(m)
	case "sleep":
		_ = os.WriteFile("ready", nil, 0o644)
		time.Sleep(time.Hour)
	case "ignore-term":
		signal.Ignore(syscall.SIGTERM)
		_ = os.WriteFile("ready", nil, 0o644)
		time.Sleep(time.Hour)
	}
	os.Exit(0)
}
