package warmpool

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// fakePool is an in-memory provider.Pool (this package's logic only; the
// process provider's pool runs real wrappers in its own tests).
type fakePool struct {
	mu       sync.Mutex
	size     map[string]int // ready
	starting map[string]int // started, not ready (slow: fills land here)
	slow     bool
	free     uint64
	fail     error
	fills    []string
	swept    bool
	drained  bool
	observer provider.PoolObserver
}

func (f *fakePool) FillPool(_ context.Context, label string, spec provider.LaunchSpec) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fills = append(f.fills, label+"@"+spec.Workspace)
	if f.fail != nil {
		return f.fail
	}
	if f.slow {
		f.starting[label]++
	} else {
		f.size[label]++
	}
	return nil
}

func (f *fakePool) PoolSize() map[string]provider.PoolCount {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]provider.PoolCount{}
	for k, v := range f.size {
		c := out[k]
		c.Ready = v
		out[k] = c
	}
	for k, v := range f.starting {
		c := out[k]
		c.Starting = v
		out[k] = c
	}
	return out
}

// ready counts the ready pooled sandboxes by profile.
func (f *fakePool) ready() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]int{}
	for k, v := range f.size {
		out[k] = v
	}
	return out
}
func (f *fakePool) SweepPool(context.Context) error         { f.swept = true; return nil }
func (f *fakePool) DrainPool(context.Context)               { f.drained = true }
func (f *fakePool) SetPoolObserver(o provider.PoolObserver) { f.observer = o }
func (f *fakePool) RootCapacity() provider.Capacity {
	return provider.Capacity{Kind: provider.CapacityMeasured, AvailableBytes: f.free}
}

func shape(profile, dir string) (provider.LaunchSpec, error) {
	if profile == "missing" {
		return provider.LaunchSpec{}, fmt.Errorf("%w: not installed", agents.ErrUnavailable)
	}
	return provider.LaunchSpec{Path: profile, Workspace: dir}, nil
}

func TestFillsEachProfileToItsSizeWithinRoom(t *testing.T) {
	t.Parallel()
	f := &fakePool{size: map[string]int{}, free: 10 << 30}
	p := New(Config{Sizes: map[string]int{"opencode": 2, "scripted": 1, "off": 0, "missing": 2}, Directory: "/workspace",
		Shape: shape, Room: f, ReserveBytes: 1 << 30}, f, nil)
	shapes := p.shapes()
	require.NotContains(t, shapes, "missing", "a profile not installed is never filled")
	require.NotContains(t, shapes, "off")
	require.InDelta(t, 1, testutil.ToFloat64(p.metrics.unavailable.WithLabelValues("missing")), 0)
	p.fill(context.Background(), shapes)
	require.Equal(t, map[string]int{"opencode": 2, "scripted": 1}, f.ready())
	require.Equal(t, []string{"opencode@/workspace", "opencode@/workspace", "scripted@/workspace"}, f.fills)

	// A claim took one: the next check refills it, and only it.
	f.size["opencode"]--
	f.observer.Claimed("opencode")
	p.fill(context.Background(), shapes)
	require.Equal(t, 2, f.ready()["opencode"])
	require.Len(t, f.fills, 4)
	require.InDelta(t, 1, testutil.ToFloat64(p.metrics.claimed.WithLabelValues("opencode")), 0)

	// No room beyond the reserve routes need: nothing starts.
	f.size["opencode"] = 0
	f.free = 1 << 30
	p.fill(context.Background(), shapes)
	require.Len(t, f.fills, 4)
	require.InDelta(t, 1, testutil.ToFloat64(p.metrics.deferred), 0)
}

// A pooled sandbox still starting counts toward its profile's size: the
// refill does not start another in its place.
func TestStartingSandboxesCountTowardTheSize(t *testing.T) {
	t.Parallel()
	f := &fakePool{size: map[string]int{}, starting: map[string]int{}, slow: true, free: 10 << 30}
	p := New(Config{Sizes: map[string]int{"scripted": 2}, Directory: "/workspace", Shape: shape, Room: f}, f, nil)
	reg := prometheus.NewRegistry()
	require.NoError(t, p.Register(reg))
	shapes := p.shapes()
	p.fill(context.Background(), shapes)
	p.fill(context.Background(), shapes)
	require.Len(t, f.fills, 2)
	require.Empty(t, f.ready())
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP agentplane_sandbox_pool_size Pooled sandboxes ready for a claim, by agent profile.
# TYPE agentplane_sandbox_pool_size gauge
agentplane_sandbox_pool_size{profile="scripted"} 0
# HELP agentplane_sandbox_pool_starting Pooled sandboxes started but not yet ready for a claim, by agent profile.
# TYPE agentplane_sandbox_pool_starting gauge
agentplane_sandbox_pool_starting{profile="scripted"} 2
`), "agentplane_sandbox_pool_size", "agentplane_sandbox_pool_starting"))
}

func TestFailedStartsBackOff(t *testing.T) {
	t.Parallel()
	f := &fakePool{size: map[string]int{}, free: 10 << 30, fail: errors.New("directory reserved")}
	p := New(Config{Sizes: map[string]int{"scripted": 2}, Directory: "/", Shape: shape, Room: f, Every: time.Hour}, f, nil)
	shapes := p.shapes()
	p.fill(context.Background(), shapes)
	p.fill(context.Background(), shapes)
	require.Len(t, f.fills, 1, "after a failed start the profile waits before it tries again")
	require.InDelta(t, 1, testutil.ToFloat64(p.metrics.failures.WithLabelValues("scripted")), 0)
}

func TestRunSweepsThenDrains(t *testing.T) {
	t.Parallel()
	f := &fakePool{size: map[string]int{}, free: 10 << 30}
	p := New(Config{Sizes: map[string]int{"scripted": 1}, Directory: "/workspace", Shape: shape, Room: f, Every: time.Millisecond}, f, nil)
	reg := prometheus.NewRegistry()
	require.NoError(t, p.Register(reg))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	require.Eventually(t, func() bool { return f.ready()["scripted"] == 1 }, 10*time.Second, time.Millisecond)
	n, err := testutil.GatherAndCount(reg, "agentplane_sandbox_pool_size", "agentplane_sandbox_pool_starting")
	require.NoError(t, err)
	require.Equal(t, 2, n)
	cancel()
	<-done
	require.True(t, f.swept, "an earlier run's pool is swept at start")
	require.True(t, f.drained, "the pool is drained when the service stops")
}
