package process

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

type poolEvents struct {
	mu     sync.Mutex
	claims []string
	misses []provider.PoolMiss
}

func (e *poolEvents) Claimed(label string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.claims = append(e.claims, label)
}

func (e *poolEvents) Missed(_ string, why provider.PoolMiss) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.misses = append(e.misses, why)
}

func (e *poolEvents) seen() ([]string, []provider.PoolMiss) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string{}, e.claims...), append([]provider.PoolMiss{}, e.misses...)
}

// poolShape is the shape both the pool and the routes launch.
func poolShape(mode, workspace string) provider.LaunchSpec {
	return provider.LaunchSpec{Path: os.Args[0], Env: []string{"HELPER_MODE=" + mode}, Workspace: workspace}
}

func poolDirs(t *testing.T, p *Provider) []string {
	t.Helper()
	ents, err := os.ReadDir(p.cfg.Root)
	require.NoError(t, err)
	var out []string
	for _, e := range ents {
		if isPoolID(e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out
}

// pooledCount counts the "helper" pooled wrappers, ready or starting.
func pooledCount(p *Provider) int {
	c := p.PoolSize()["helper"]
	return c.Ready + c.Starting
}

// waitPooledRunning waits for a pooled helper to run (it wrote "ready" in
// its workspace) and returns its pool id.
func waitPooledRunning(t *testing.T, p *Provider) string {
	t.Helper()
	var id string
	require.Eventually(t, func() bool {
		for _, d := range poolDirs(t, p) {
			if _, err := os.Stat(filepath.Join(p.WorkspaceDir(d, "/work/repo"), "ready")); err == nil {
				id = d
				return true
			}
		}
		return false
	}, 20*time.Second, 10*time.Millisecond, "the pooled helper runs")
	return id
}

// waitPooledReady is waitPooledRunning until the pool counts it ready too.
func waitPooledReady(t *testing.T, p *Provider) string {
	t.Helper()
	id := waitPooledRunning(t, p)
	require.Eventually(t, func() bool { return p.PoolSize()["helper"].Ready > 0 }, 20*time.Second, 10*time.Millisecond,
		"it said it is ready on its claim socket")
	return id
}

// pooledProvider is a provider with one pooled "pooled" helper for
// /work/repo, its observer, and a sandbox id; the pool drains at cleanup.
func pooledProvider(t *testing.T) (*Provider, *poolEvents, string) {
	t.Helper()
	p := newProvider(t)
	ev := &poolEvents{}
	p.SetPoolObserver(ev)
	sb := sandboxID(t, p)
	t.Cleanup(func() { p.DrainPool(context.Background()) })
	require.NoError(t, p.FillPool(context.Background(), "helper", poolShape("pooled", "/work/repo")))
	return p, ev, sb
}

func TestPooledWrapperServesOneRuntimeKeyOnce(t *testing.T) {
	p, ev, sb := pooledProvider(t)
	ctx := context.Background()
	require.Equal(t, 1, pooledCount(p))
	pooledID := waitPooledReady(t, p)
	require.Equal(t, provider.PoolCount{Ready: 1}, p.PoolSize()["helper"])
	require.Equal(t, provider.Absent, p.Discover(ctx, sb, "k").Kind, "a pooled wrapper belongs to no sandbox")

	spec := poolShape("pooled", "/work/repo")
	spec.Markers = provider.Markers{SandboxID: sb, RuntimeKey: "k", InstanceID: "i1", Generation: 3}
	spec.Identity = &provider.Identity{Allocation: "a1", FenceToken: 9, Credential: "aplc_test"}
	o, err := p.Launch(ctx, spec)
	require.NoError(t, err)
	claims, misses := ev.seen()
	require.Equal(t, []string{"helper"}, claims)
	require.Empty(t, misses)
	require.Empty(t, p.PoolSize()["helper"], "a claimed wrapper leaves the pool")
	require.NotContains(t, poolDirs(t, p), pooledID, "its pooled directory is gone")

	// The wrapper got the key's identity, and works in the key's workspace.
	claimFile := filepath.Join(p.WorkspaceDir(sb, "/work/repo"), "claim")
	require.Eventually(t, func() bool { _, err := os.Stat(claimFile); return err == nil }, 20*time.Second, 10*time.Millisecond)
	got, err := os.ReadFile(claimFile)
	require.NoError(t, err)
	require.Equal(t, sb+" k i1 a1", string(got))
	b, err := os.ReadFile(filepath.Join(p.HomeDir(sb, "k"), ".agentplane-workspace"))
	require.NoError(t, err)
	require.Equal(t, "/work/repo\n", string(b))

	// Discovery finds it under the key, by its record.
	d := p.Discover(ctx, sb, "k")
	require.Equal(t, provider.Present, d.Kind)
	require.Len(t, d.Observed, 1)
	require.Equal(t, o.PID, d.Observed[0].PID)
	require.Equal(t, "i1", d.Observed[0].InstanceID)
	require.Equal(t, uint64(3), d.Observed[0].Generation)
	sd := p.DiscoverSandbox(ctx, sb)
	require.Equal(t, provider.Present, sd.Kind)
	require.Len(t, sd.ByRuntimeKey["k"], 1)

	// The next fresh key finds the pool empty and launches cold.
	spec2 := poolShape("pooled", "/work/repo")
	spec2.Markers = provider.Markers{SandboxID: sb + "0", RuntimeKey: "k2", InstanceID: "i2", Generation: 1}
	spec2.Identity = &provider.Identity{Allocation: "a1", FenceToken: 9, Credential: "aplc_test"}
	o2, err := p.Launch(ctx, spec2)
	require.NoError(t, err)
	require.NotEqual(t, o.PID, o2.PID)
	_, misses = ev.seen()
	require.Equal(t, []provider.PoolMiss{provider.MissEmpty}, misses)

	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb, RuntimeKey: "k"}).Kind)
	require.False(t, alive(o.PID))
	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb + "0", RuntimeKey: "k2"}).Kind)
}

func TestPoolMissesAResumedKey(t *testing.T) {
	p, ev, sb := pooledProvider(t)
	ctx := context.Background()
	// The key has its home already (it ran before): the pooled wrapper
	// cannot take it on, its agent having started in another home.
	_, err := p.PrepareWorkspace(ctx, sb, "/work/repo", "k")
	require.NoError(t, err)
	spec := poolShape("pooled", "/work/repo")
	spec.Markers = provider.Markers{SandboxID: sb, RuntimeKey: "k", InstanceID: "i1", Generation: 2}
	spec.Identity = &provider.Identity{Allocation: "a1", FenceToken: 9, Credential: "aplc_test"}
	_, err = p.Launch(ctx, spec)
	require.NoError(t, err)
	claims, misses := ev.seen()
	require.Empty(t, claims)
	require.Equal(t, []provider.PoolMiss{provider.MissNotFresh}, misses)
	require.Equal(t, 1, pooledCount(p), "the pooled wrapper still waits")
	// Another shape (another directory) is no launch of the pool's.
	other := poolShape("pooled", "/work/other")
	other.Markers = provider.Markers{SandboxID: sb, RuntimeKey: "k3", InstanceID: "i3", Generation: 1}
	other.Identity = spec.Identity
	_, err = p.Launch(ctx, other)
	require.NoError(t, err)
	claims, _ = ev.seen()
	require.Empty(t, claims)
	require.Equal(t, 1, pooledCount(p))
	for _, k := range []string{"k", "k3"} {
		require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb, RuntimeKey: k}).Kind)
	}
}

// A pooled wrapper is claimed only once it said it is ready (it runs
// inside its boundary, every mount made): before that, renaming its
// directories would pull them from under bubblewrap.
func TestPoolClaimsOnlyAReadyWrapper(t *testing.T) {
	p := newProvider(t)
	ev := &poolEvents{}
	p.SetPoolObserver(ev)
	sb := sandboxID(t, p)
	ctx := context.Background()
	t.Cleanup(func() { p.DrainPool(ctx) })
	silent := poolShape("pooled", "/work/repo")
	silent.Env = append(silent.Env, "HELPER_NOT_READY=1")
	require.NoError(t, p.FillPool(ctx, "helper", silent))
	id := waitPooledRunning(t, p)
	require.Equal(t, provider.PoolCount{Starting: 1}, p.PoolSize()["helper"])

	spec := silent
	spec.Markers = provider.Markers{SandboxID: sb, RuntimeKey: "k", InstanceID: "i1", Generation: 1}
	spec.Identity = &provider.Identity{Allocation: "a1", FenceToken: 9, Credential: "aplc_test"}
	_, err := p.Launch(ctx, spec)
	require.NoError(t, err)
	claims, misses := ev.seen()
	require.Empty(t, claims)
	require.Equal(t, []provider.PoolMiss{provider.MissStarting}, misses)
	require.Contains(t, poolDirs(t, p), id, "the starting pooled wrapper keeps its directories")
	require.Equal(t, provider.PoolCount{Starting: 1}, p.PoolSize()["helper"])
	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb, RuntimeKey: "k"}).Kind)
}

// A claim that fails half-way (here: the key's namespace record cannot be
// written) destroys the pooled wrapper, takes back what it moved into the
// key's tree, counts a miss "claim", and the launch goes on cold: the key
// starts fresh, never in the pooled sandbox's workspace or home.
func TestFailedClaimLeavesTheKeyFresh(t *testing.T) {
	p, ev, sb := pooledProvider(t)
	ctx := context.Background()
	pooledID := waitPooledReady(t, p)
	us, err := p.scan(pooledID)
	require.NoError(t, err)
	require.Len(t, us, 1)
	pooledPID := us[0].anchor.pid
	require.NoError(t, os.WriteFile(filepath.Join(p.WorkspaceDir(pooledID, "/work/repo"), "pooled"), nil, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(p.HomeDir(pooledID, poolKey), "pooled"), nil, 0o644))

	spec := poolShape("pooled", "/work/repo")
	spec.Markers = provider.Markers{SandboxID: sb, RuntimeKey: "k", InstanceID: "i1", Generation: 1}
	spec.Identity = &provider.Identity{Allocation: "a1", FenceToken: 9, Credential: "aplc_test"}
	// A directory where the record's temporary file goes: its write fails.
	block := filepath.Join(p.runDir(sb), WorkspaceName("i1")+".json.tmp")
	require.NoError(t, os.MkdirAll(filepath.Join(block, "x"), 0o700))
	_, err = p.Launch(ctx, spec)
	require.NoError(t, err, "launched cold")
	claims, misses := ev.seen()
	require.Empty(t, claims)
	require.Equal(t, []provider.PoolMiss{provider.MissClaim}, misses)
	require.False(t, alive(pooledPID), "the pooled wrapper was destroyed")
	require.NotContains(t, poolDirs(t, p), pooledID)
	require.Zero(t, pooledCount(p))
	for _, d := range []string{p.WorkspaceDir(sb, "/work/repo"), p.HomeDir(sb, "k")} {
		_, err := os.Lstat(filepath.Join(d, "pooled"))
		require.ErrorIs(t, err, fs.ErrNotExist, "%s: the claim's move was taken back", d)
	}
	require.NoError(t, os.RemoveAll(block))
	require.Equal(t, provider.StopAbsent, p.Stop(ctx, provider.StopTarget{SandboxID: sb, RuntimeKey: "k"}).Kind)
}

func TestPooledWrapperEndsWithItsSocket(t *testing.T) {
	p := newProvider(t)
	ctx := context.Background()
	require.NoError(t, p.FillPool(ctx, "helper", poolShape("pooled", "/work/repo")))
	id := waitPooledReady(t, p)
	us, err := p.scan(id)
	require.NoError(t, err)
	require.Len(t, us, 1)
	pid := us[0].anchor.pid
	p.DrainPool(ctx)
	require.False(t, alive(pid))
	require.Empty(t, poolDirs(t, p), "a drained pool leaves no directory")
	require.Empty(t, p.PoolSize()["helper"])
}

func TestPooledWrapperThatDiesLeavesThePool(t *testing.T) {
	p := newProvider(t)
	ctx := context.Background()
	require.NoError(t, p.FillPool(ctx, "helper", poolShape("pooled", "/work/repo")))
	id := waitPooledReady(t, p)
	require.Equal(t, provider.StopAbsent, p.stopPooled(ctx, id).Kind)
	require.Eventually(t, func() bool { return p.PoolSize()["helper"] == provider.PoolCount{} && len(poolDirs(t, p)) == 0 },
		20*time.Second, 10*time.Millisecond)
	p.Wait()
}

func TestSweepPoolRemovesWhatAnEarlierIncarnationLeft(t *testing.T) {
	root := t.TempDir()
	ctx := context.Background()
	// A pool whose service died: its claim sockets closed (the kernel closes a
	// dead process's descriptors), its directories left.
	gone, err := New(Config{Root: root, Isolation: isolation(t)})
	require.NoError(t, err)
	require.NoError(t, gone.FillPool(ctx, "helper", poolShape("pooled", "/work/repo")))
	goneID := waitPooledReady(t, gone)
	gone.pool.mu.Lock()
	for _, list := range gone.pool.idle {
		for _, e := range list {
			_ = e.claimW.Close()
		}
	}
	gone.pool.idle = nil
	gone.pool.mu.Unlock()
	require.Eventually(t, func() bool { us, err := gone.scan(goneID); return err == nil && len(us) == 0 },
		20*time.Second, 10*time.Millisecond, "a pooled wrapper ends with its socket")
	// Another live replica's pool on the same root.
	live, err := New(Config{Root: root, Isolation: isolation(t)})
	require.NoError(t, err)
	t.Cleanup(func() { live.DrainPool(ctx); live.Wait() })
	require.NoError(t, live.FillPool(ctx, "helper", poolShape("sleep", "/work/repo")))
	var liveID string
	require.Eventually(t, func() bool {
		for _, d := range poolDirs(t, live) {
			if _, err := os.Stat(filepath.Join(live.WorkspaceDir(d, "/work/repo"), "ready")); err == nil && d != goneID {
				liveID = d
				return true
			}
		}
		return false
	}, 20*time.Second, 10*time.Millisecond)

	restarted, err := New(Config{Root: root, Isolation: isolation(t)})
	require.NoError(t, err)
	require.NoError(t, restarted.SweepPool(ctx))
	require.Equal(t, []string{liveID}, poolDirs(t, restarted), "the dead pool's directory went, the live one's stayed")
	us, err := restarted.scan(liveID)
	require.NoError(t, err)
	require.Len(t, us, 1, "the live replica's pooled wrapper runs on")
	gone.Wait()
}
