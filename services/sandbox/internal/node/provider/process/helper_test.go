package process

import (
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"agentplane.dev/services/sandbox/internal/node/provider"
	"golang.org/x/sys/unix"
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
	case "cwd":
		// Where the wrapper finds itself: the route's directory, and its HOME.
		wd, _ := os.Getwd()
		_ = os.WriteFile("cwd", []byte(wd+" "+os.Getenv("HOME")), 0o644)
		_ = os.WriteFile("ready", nil, 0o644)
		time.Sleep(time.Hour)
	case "leak":
		// What a runtime leaves behind: a background child, one in its own
		// session, a double fork reparented to init, one without environment.
		_ = exec.Command("/bin/sh", "-c", "sleep 600 & setsid sleep 600 & (sleep 600 &) ; env -i sleep 600 &").Run()
		_ = os.WriteFile("ready", nil, 0o644)
		time.Sleep(time.Hour)
	case "nodump":
		// A runtime that hides itself: non-dumpable, its /proc files are
		// handed to a root its user namespace does not map; a background
		// child does the same after its exec.
		_ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0)
		_ = exec.Command("/bin/sh", "-c", "sleep 600 &").Run()
		_ = os.WriteFile("ready", nil, 0o644)
		time.Sleep(time.Hour)
	case "hog":
		// A runtime that holds 256 MiB of touched anonymous memory.
		b := make([]byte, 256<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		_ = os.WriteFile("ready", nil, 0o644)
		time.Sleep(time.Hour)
		runtime.KeepAlive(b)
	case "pooled":
		// A pooled wrapper: ready at once (it says so on fd 3), then it
		// waits for its claim there and writes what it got where it works
		// (the workspace); the socket closing without a claim ends it.
		_ = os.WriteFile("ready", nil, 0o644)
		claim := os.NewFile(3, "claim")
		if os.Getenv("HELPER_NOT_READY") == "" {
			_ = provider.WriteReady(claim)
		}
		c, err := provider.ReadClaim(claim)
		if err != nil {
			os.Exit(0)
		}
		_ = os.WriteFile("claim", []byte(c.SandboxID+" "+c.RuntimeKey+" "+c.InstanceID+" "+c.Allocation), 0o644)
		time.Sleep(time.Hour)
	case "ignore-term":
		signal.Ignore(syscall.SIGTERM)
		_ = os.WriteFile("ready", nil, 0o644)
		time.Sleep(time.Hour)
	}
	os.Exit(0)
}
