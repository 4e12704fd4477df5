package reconciler

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/services/sandbox/internal/node/provider"
	"agentplane.dev/services/sandbox/internal/node/provider/process"
)

// The test binary doubles as a wrapper ("sleep") and as a launching
// component ("launcher") that the leak test kills with SIGKILL.
func TestMain(m *testing.M) {
	switch os.Getenv("HELPER_MODE") {
	case "":
		goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"))
	case "sleep":
		time.Sleep(time.Hour)
	case "launcher":
		if err := launcher(); err != nil {
			fmt.Fprintln(os.Stderr, "launcher:", err)
			os.Exit(1)
		}
		time.Sleep(time.Hour)
	}
	os.Exit(0)
}

// launcher is a sandbox-service stand-in: it takes the sandbox's fence,
// launches one wrapper through the reconciler (lease owns_wrapper) and two
// more behind its back (no lease; one unmarked), reports their pids, then
// waits to be killed.
func launcher() error {
	ctx := context.Background()
	sb, root := os.Getenv("T_SANDBOX"), os.Getenv("T_ROOT")
	rdb := redis.NewClient(&redis.Options{Addr: os.Getenv("T_REDIS")})
	l, err := fence.Acquire(ctx, rdb, sb, "launcher", 2*time.Second)
	if err != nil {
		return err
	}
	p, err := process.New(process.Config{Root: root})
	if err != nil {
		return err
	}
	r := New(Config{Redis: rdb, Provider: p})
	if err := r.Adopt(ctx, sb, fixedFence{sb, l.Token}); err != nil {
		return err
	}
	spec := func(m provider.Markers) provider.LaunchSpec {
		return provider.LaunchSpec{Markers: m, Path: os.Args[0], Env: []string{"HELPER_MODE=sleep"}, Workspace: "/ws/" + m.RuntimeKey}
	}
	var pids []string
	if _, err := r.EnsureWrapper(ctx, sb, "k1", func(ctx context.Context, m provider.Markers) error {
		o, err := p.Launch(ctx, spec(m))
		pids = append(pids, fmt.Sprint(o.PID))
		return err
	}); err != nil {
		return err
	}
	o, err := p.Launch(ctx, spec(provider.Markers{SandboxID: sb, RuntimeKey: "k2", InstanceID: "ghost", Generation: 9}))
	if err != nil {
		return err
	}
	pids = append(pids, fmt.Sprint(o.PID))
	// An unmarked wrapper: sandbox and key markers, no instance.
	o, err = p.Launch(ctx, spec(provider.Markers{SandboxID: sb, RuntimeKey: "k3", InstanceID: "x"}))
	if err != nil {
		return err
	}
	pids = append(pids, fmt.Sprint(o.PID))
	// Written whole, then renamed: the test reads the file as soon as it
	// exists, and os.WriteFile creates it before writing.
	tmp := os.Getenv("T_PIDS") + ".tmp"
	if err := os.WriteFile(tmp, []byte(strings.Join(pids, " ")), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, os.Getenv("T_PIDS"))
}

// fixedFence is a fence lease's resource and token as a test holds them
// (the service passes its *ownership.Owner).
type fixedFence struct {
	resource string
	token    uint64
}

func (f fixedFence) Resource() string { return f.resource }
func (f fixedFence) Token() uint64    { return f.token }
