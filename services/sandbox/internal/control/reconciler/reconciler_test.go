package reconciler

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testclock"
	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/leasestore"
	"agentplane.dev/services/sandbox/internal/node/provider"
	"agentplane.dev/services/sandbox/internal/node/provider/process"
)

func uniqueSandbox() string { return "t" + strconv.FormatInt(time.Now().UnixNano(), 36) }

// markedPIDs scans /proc directly (not through the provider) for live
// processes carrying the sandbox marker.
func markedPIDs(t *testing.T, sb string) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile("/proc/" + e.Name() + "/environ")
		if err != nil || !bytes.Contains(env, []byte("\x00"+provider.EnvSandbox+"="+sb+"\x00")) && !bytes.HasPrefix(env, []byte(provider.EnvSandbox+"="+sb+"\x00")) {
			continue
		}
		if stat, err := os.ReadFile("/proc/" + e.Name() + "/stat"); err == nil {
			s := string(stat)
			if strings.HasPrefix(strings.TrimSpace(s[strings.LastIndexByte(s, ')')+1:]), "Z") {
				continue
			}
		}
		out = append(out, pid)
	}
	return out
}

type env struct {
	rdb   *redis.Client
	srv   *redistest.Server
	clock *testclock.Clock
	prov  *process.Provider
	sb    string
}

func setup(t *testing.T) *env {
	srv := redistest.Start(t)
	p, err := process.New(process.Config{Root: t.TempDir()})
	require.NoError(t, err)
	e := &env{rdb: srv.Client(t), srv: srv, clock: testclock.New(time.Now().UTC().Truncate(time.Millisecond)), prov: p, sb: uniqueSandbox()}
	t.Cleanup(func() { // never leave a wrapper behind, even on failure
		if sd := p.DiscoverSandbox(context.Background(), e.sb); sd.Kind == provider.Present {
			for k := range sd.ByRuntimeKey {
				p.Stop(context.Background(), provider.StopTarget{SandboxID: e.sb, RuntimeKey: k})
			}
		}
		p.Wait()
	})
	return e
}

func (e *env) reconciler(t *testing.T, prov provider.AgentSandbox, hook func(context.Context, string, string, uint64)) *Reconciler {
	t.Helper()
	l, err := fence.Acquire(context.Background(), e.rdb, e.sb, "owner-"+strconv.FormatInt(time.Now().UnixNano(), 10), time.Minute)
	require.NoError(t, err)
	r := New(Config{Redis: e.rdb, Provider: prov, Now: e.clock.Now, BeforeStop: hook})
	if err := r.Adopt(context.Background(), e.sb, fixedFence{e.sb, l.Token}); err != nil {
		require.ErrorIs(t, err, ErrInspectionFailed) // adopted anyway; the sweep is retried
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	return r
}

func (e *env) launch(key string) LaunchFunc {
	return func(ctx context.Context, m provider.Markers) error {
		_, err := e.prov.Launch(ctx, provider.LaunchSpec{Markers: m, Path: os.Args[0], Env: []string{"HELPER_MODE=sleep"}, Workspace: "/ws/" + key})
		return err
	}
}

func TestEnsureWrapperLaunchReuseRefuse(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	r := e.reconciler(t, e.prov, nil)

	d, err := r.EnsureWrapper(ctx, e.sb, "a", e.launch("a"))
	require.NoError(t, err)
	require.Equal(t, Launched, d.Action)
	require.Equal(t, uint64(0), d.Markers.Generation)
	d2, err := r.EnsureWrapper(ctx, e.sb, "a", e.launch("a"))
	require.NoError(t, err)
	require.Equal(t, Reused, d2.Action)
	require.Equal(t, d.Markers, d2.Markers)

	// Key a2 is independent of a: it launches its own wrapper.
	d3, err := r.EnsureWrapper(ctx, e.sb, "a2", e.launch("a2"))
	require.NoError(t, err)
	require.Equal(t, Launched, d3.Action)

	// A duplicate wrapper of a → stop requested, refused, delivery held.
	_, err = e.prov.Launch(ctx, provider.LaunchSpec{Markers: d.Markers, Path: os.Args[0], Env: []string{"HELPER_MODE=sleep"}, Workspace: "/ws/a"})
	require.NoError(t, err)
	d4, err := r.EnsureWrapper(ctx, e.sb, "a", e.launch("a"))
	require.ErrorIs(t, err, ErrRefused)
	require.Equal(t, Refused, d4.Action)
	require.Positive(t, d4.RetryAfter)
	l, err := r.Lease(ctx, e.sb, "a")
	require.NoError(t, err)
	require.True(t, l.HoldsDelivery())

	ok, _, err := r.AbsenceVerified(ctx, e.sb, "a") // drives the due attempt
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, provider.Absent, e.prov.Discover(ctx, e.sb, "a").Kind)
	require.Equal(t, provider.Present, e.prov.Discover(ctx, e.sb, "a2").Kind, "a2 untouched")

	// From none with discovery absent, a new generation launches.
	d5, err := r.EnsureWrapper(ctx, e.sb, "a", e.launch("a"))
	require.NoError(t, err)
	require.Equal(t, Launched, d5.Action)
	require.Equal(t, uint64(1), d5.Markers.Generation, "next_generation never decreases")

	// Events for a stale instance change nothing.
	require.NoError(t, r.StartupVerified(ctx, e.sb, "a", d.Markers.InstanceID))
	l, err = r.Lease(ctx, e.sb, "a")
	require.NoError(t, err)
	require.False(t, l.Verified)
	require.NoError(t, r.StartupVerified(ctx, e.sb, "a", d5.Markers.InstanceID))
	l, err = r.Lease(ctx, e.sb, "a")
	require.NoError(t, err)
	require.True(t, l.Verified)
}

// Leak test: a launching component is killed with SIGKILL after starting
// wrappers; a new reconciler finds and stops every one of them.
func TestLeakedWrappersAfterKill9(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	root := t.TempDir()
	pidsFile := filepath.Join(t.TempDir(), "pids")
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "HELPER_MODE=launcher", "T_SANDBOX="+e.sb, "T_ROOT="+root, "T_REDIS="+e.srv.Addr(), "T_PIDS="+pidsFile)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	require.Eventually(t, func() bool { _, err := os.Stat(pidsFile); return err == nil }, 30*time.Second, 20*time.Millisecond, "launcher: %s", &stderr)
	require.NoError(t, cmd.Process.Kill()) // kill -9 the component that launched them
	_ = cmd.Wait()

	b, err := os.ReadFile(pidsFile)
	require.NoError(t, err)
	leaked := strings.Fields(string(b))
	require.Len(t, leaked, 3)
	require.Len(t, markedPIDs(t, e.sb), 3, "wrappers outlive their launcher")

	// A new incarnation: its own provider instance (it started nothing),
	// a new fence token once the old lease expired.
	p2, err := process.New(process.Config{Root: root})
	require.NoError(t, err)
	var l *fence.Lease
	require.Eventually(t, func() bool {
		l, err = fence.Acquire(ctx, e.rdb, e.sb, "new", time.Minute)
		return err == nil
	}, 30*time.Second, 100*time.Millisecond)
	r := New(Config{Redis: e.rdb, Provider: p2, Now: e.clock.Now})
	require.NoError(t, r.Adopt(ctx, e.sb, fixedFence{e.sb, l.Token}))
	for _, k := range []string{"k2", "k3"} {
		lk, err := r.Lease(ctx, e.sb, k)
		require.NoError(t, err)
		require.Equal(t, lease.StopNeeded, lk.State, "sweep requested a stop of leaked %s", k)
	}
	// k1 is owned by its lease but never verified: its startup deadline
	// stops it.
	e.clock.Add(11 * time.Minute)
	require.Eventually(t, func() bool {
		require.NoError(t, r.Tick(ctx))
		return len(markedPIDs(t, e.sb)) == 0
	}, 60*time.Second, 50*time.Millisecond, "left: %v", debugLeases(t, r, e.sb))
	for _, k := range []string{"k1", "k2", "k3"} {
		ok, _, err := r.AbsenceVerified(ctx, e.sb, k)
		require.NoError(t, err)
		require.True(t, ok, k)
	}
	require.Empty(t, markedPIDs(t, e.sb), "no process with the markers exists")
}

// countingProvider records provider.Stop calls and overlapping ones.
type countingProvider struct {
	provider.AgentSandbox
	calls, running, overlaps atomic.Int32
}

func (c *countingProvider) Stop(ctx context.Context, t provider.StopTarget) provider.StopResult {
	c.calls.Add(1)
	if c.running.Add(1) > 1 {
		c.overlaps.Add(1)
	}
	defer c.running.Add(-1)
	return c.AgentSandbox.Stop(ctx, t)
}

// Crash safety: the reconciler dies after persisting stopping and before
// the provider call; a restarted one resumes after the watchdog and never
// runs two attempts at once.
func TestCrashAfterStoppingClaim(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	cp := &countingProvider{AgentSandbox: e.prov}
	claimed := make(chan uint64, 1)
	r1 := e.reconciler(t, cp, func(ctx context.Context, _, _ string, attempt uint64) {
		claimed <- attempt
		<-ctx.Done() // "killed" here, before the provider call
	})
	d, err := r1.EnsureWrapper(ctx, e.sb, "k", e.launch("k"))
	require.NoError(t, err)
	require.NoError(t, r1.RequestStop(ctx, e.sb, "k", "session-delete"))

	ctx1, kill := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r1.Tick(ctx1) }()
	require.Equal(t, uint64(1), <-claimed)
	l, err := r1.Lease(ctx, e.sb, "k")
	require.NoError(t, err)
	require.Equal(t, lease.Stopping, l.State, "claim persisted before provider I/O")
	require.Equal(t, e.clock.Now().Add(45*time.Second), l.WatchdogAt)
	kill()
	<-done //nolint:errcheck // the killed tick's error is expected and irrelevant
	require.Zero(t, cp.calls.Load())
	require.Len(t, markedPIDs(t, e.sb), 1)

	// Restart (a new owner with a newer token).
	r2 := New(Config{Redis: e.rdb, Provider: cp, Now: e.clock.Now})
	l2, err := fence.Acquire(ctx, e.rdb, e.sb, "restarted", time.Minute)
	if err != nil { // the first owner's fence lease is still held: release it like a crash would expire it
		require.NoError(t, e.rdb.Del(ctx, fence.LeaseKey(e.sb)).Err())
		l2, err = fence.Acquire(ctx, e.rdb, e.sb, "restarted", time.Minute)
	}
	require.NoError(t, err)
	require.NoError(t, r2.Adopt(ctx, e.sb, fixedFence{e.sb, l2.Token}))
	require.NoError(t, r2.Tick(ctx))
	require.Zero(t, cp.calls.Load(), "no second attempt before the watchdog")
	ok, retry, err := r2.AbsenceVerified(ctx, e.sb, "k")
	require.NoError(t, err)
	require.False(t, ok)
	require.Equal(t, 45*time.Second, retry)

	e.clock.Add(45 * time.Second)
	require.NoError(t, r2.Tick(ctx))
	l, err = r2.Lease(ctx, e.sb, "k")
	require.NoError(t, err)
	require.Equal(t, lease.StopNeeded, l.State, "attempt 1 expired")
	require.Equal(t, e.clock.Now().Add(5*time.Second), l.NextAttemptAt)
	require.Zero(t, cp.calls.Load())

	e.clock.Add(5 * time.Second)
	require.NoError(t, r2.Tick(ctx))
	require.Equal(t, int32(1), cp.calls.Load())
	require.Zero(t, cp.overlaps.Load())
	l, err = r2.Lease(ctx, e.sb, "k")
	require.NoError(t, err)
	require.Equal(t, lease.None, l.State)
	require.Equal(t, uint64(2), l.LastAttempt)
	require.Empty(t, markedPIDs(t, e.sb))

	// The old owner's late write is fenced off.
	_, err = r1.EnsureWrapper(ctx, e.sb, "k", e.launch("k"))
	require.ErrorIs(t, err, fence.ErrStaleToken)
	require.Empty(t, markedPIDs(t, e.sb), "stale owner launched nothing")
	_ = d
}

// A wrapper whose stopper wakes up after its watchdog never calls the
// provider, and its late result is discarded.
func TestLateAttemptIsDiscarded(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	cp := &countingProvider{AgentSandbox: e.prov}
	release := make(chan struct{})
	claimed := make(chan struct{}, 1)
	var first atomic.Bool
	r := e.reconciler(t, cp, func(context.Context, string, string, uint64) {
		if first.CompareAndSwap(false, true) {
			claimed <- struct{}{}
			<-release
		}
	})
	_, err := r.EnsureWrapper(ctx, e.sb, "k", e.launch("k"))
	require.NoError(t, err)
	require.NoError(t, r.RequestStop(ctx, e.sb, "k", "x"))
	done := make(chan error, 1)
	go func() { done <- r.Tick(ctx) }()
	<-claimed
	e.clock.Add(46 * time.Second) // the stuck attempt outlives its watchdog
	close(release)
	require.NoError(t, <-done)
	require.Zero(t, cp.calls.Load(), "a late attempt never calls the provider")
	require.NoError(t, r.Tick(ctx)) // attempt 1 expired → backoff 5 s
	require.Zero(t, cp.calls.Load())
	e.clock.Add(5 * time.Second)
	require.NoError(t, r.Tick(ctx))
	l, err := r.Lease(ctx, e.sb, "k")
	require.NoError(t, err)
	require.Equal(t, lease.None, l.State)
	require.Equal(t, int32(1), cp.calls.Load())
}

// An unreadable /proc entry is never absence: a deletion waiting on it
// stays blocked, and the stop keeps being retried.
func TestDeletionBlockedOnInspectionFailure(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	proc := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(proc, "42", "environ"), 0o755)) // read fails: EISDIR
	require.NoError(t, os.WriteFile(filepath.Join(proc, "42", "status"), []byte("Uid:\t0\t0\t0\t0\nCapPrm:\t0000000000000000\n"), 0o644))
	blind, err := process.New(process.Config{Root: t.TempDir(), ProcRoot: proc, Sleep: func(context.Context, time.Duration) error { return nil }})
	require.NoError(t, err)
	r := e.reconciler(t, blind, nil)

	ok, retry, err := r.AbsenceVerified(ctx, e.sb, "k")
	require.NoError(t, err)
	require.False(t, ok, "none lease + inspection_failed is not absence")
	require.Positive(t, retry)
	_, err = r.EnsureWrapper(ctx, e.sb, "k", func(context.Context, provider.Markers) error { t.Fatal("launched blind"); return nil })
	require.ErrorIs(t, err, ErrInspectionFailed)

	require.NoError(t, r.RequestStop(ctx, e.sb, "k", "session-delete"))
	for range 10 {
		ok, _, err := r.AbsenceVerified(ctx, e.sb, "k")
		require.NoError(t, err)
		require.False(t, ok)
		ok, _, err = r.DeletionAllowed(ctx, e.sb, "k")
		require.NoError(t, err)
		require.False(t, ok)
		e.clock.Add(10 * time.Second)
	}
	l, err := r.Lease(ctx, e.sb, "k")
	require.NoError(t, err)
	require.NotEqual(t, lease.None, l.State)
	require.Positive(t, l.Attempts)
}

// A lease that fails to parse is quarantined as exhausted stop_needed and
// holds delivery; it is never read as none.
func TestUnparseableLeaseIsQuarantined(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	r := e.reconciler(t, e.prov, nil)
	require.NoError(t, e.rdb.HSet(ctx, leasestore.Key(e.sb), "k", "{garbage").Err())
	l, err := r.Lease(ctx, e.sb, "k")
	require.NoError(t, err)
	require.Equal(t, lease.StopNeeded, l.State)
	require.True(t, l.Exhausted)
	_, err = r.EnsureWrapper(ctx, e.sb, "k", e.launch("k"))
	require.ErrorIs(t, err, ErrRefused)
	ok, _, err := r.AbsenceVerified(ctx, e.sb, "k") // observes: nothing runs → released
	require.NoError(t, err)
	require.True(t, ok)
}

func debugLeases(t *testing.T, r *Reconciler, sb string) string {
	var out []string
	for _, k := range []string{"k1", "k2", "k3"} {
		l, err := r.Lease(context.Background(), sb, k)
		out = append(out, k+":"+string(l.State)+":"+l.StopReason+":"+strconv.Itoa(l.Attempts))
		_ = err
	}
	out = append(out, "pids:"+strings.Trim(strings.Join(strings.Fields(strings.Trim(fmtInts(markedPIDs(t, sb)), "[]")), ","), ""))
	return strings.Join(out, " ")
}

func fmtInts(v []int) string {
	var s []string
	for _, i := range v {
		s = append(s, strconv.Itoa(i))
	}
	return strings.Join(s, " ")
}

// A stop that frees a refused key tells Config.Stopped, so the driver can
// retry route preparation at once instead of after RetryAfter (≥ 1 s).
func TestStoppedHookFiresWhenARefusedKeyIsFree(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	l, err := fence.Acquire(ctx, e.rdb, e.sb, "owner-hook", time.Minute)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	var stopped []string
	r := New(Config{Redis: e.rdb, Provider: e.prov, Now: e.clock.Now,
		Stopped: func(sb, key string) { stopped = append(stopped, sb+"/"+key) }})
	require.NoError(t, r.Adopt(ctx, e.sb, fixedFence{e.sb, l.Token}))

	d, err := r.EnsureWrapper(ctx, e.sb, "k", e.launch("k"))
	require.NoError(t, err)
	_, err = e.prov.Launch(ctx, provider.LaunchSpec{Markers: d.Markers, Path: os.Args[0], Env: []string{"HELPER_MODE=sleep"}, Workspace: "/ws/k"})
	require.NoError(t, err)
	_, err = r.EnsureWrapper(ctx, e.sb, "k", e.launch("k"))
	require.ErrorIs(t, err, ErrRefused)
	require.Empty(t, stopped, "nothing is free yet")

	ok, _, err := r.AbsenceVerified(ctx, e.sb, "k") // drives the stop attempt
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, []string{e.sb + "/k"}, stopped)
}

// Issue 33 item 7: stop attempts exhausted by an inspection outage (an
// unreadable /proc entry is never absence) see the recovered inspection at
// the exhausted lease's first recheck, 10 s after exhaustion, and the
// deletion completes then, not at the next 10-minute step. The provider's
// /proc is a symlink: to a tree with an unreadable entry during the outage,
// to the host's /proc after it.
func TestExhaustedByAnInspectionOutageRechecksSoon(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	blindProc := t.TempDir()
	bad := filepath.Join(blindProc, "42")
	require.NoError(t, os.MkdirAll(filepath.Join(bad, "environ"), 0o755)) // read fails: EISDIR
	require.NoError(t, os.WriteFile(filepath.Join(bad, "status"), []byte("Uid:\t0\t0\t0\t0\nCapPrm:\t0000000000000000\n"), 0o644))
	proc := filepath.Join(t.TempDir(), "proc")
	require.NoError(t, os.Symlink(blindProc, proc))
	blind, err := process.New(process.Config{Root: t.TempDir(), ProcRoot: proc, Sleep: func(context.Context, time.Duration) error { return nil }})
	require.NoError(t, err)
	r := e.reconciler(t, blind, nil)

	require.NoError(t, r.RequestStop(ctx, e.sb, "k", "session-delete"))
	var l lease.Lease
	for range 20 {
		ok, _, err := r.DeletionAllowed(ctx, e.sb, "k")
		require.NoError(t, err)
		require.False(t, ok, "blind: never absence")
		if l, err = r.Lease(ctx, e.sb, "k"); err != nil || l.Exhausted {
			break
		}
		e.clock.Add(10 * time.Second)
	}
	require.NoError(t, err)
	require.True(t, l.Exhausted, "the attempts are exhausted by the outage")
	require.Equal(t, l.ExhaustedAt.Add(10*time.Second), l.NextAttemptAt, "the first recheck comes soon")

	// /proc readable again, and nothing of the sandbox runs.
	require.NoError(t, os.Remove(proc))
	require.NoError(t, os.Symlink("/proc", proc))
	e.clock.Add(10 * time.Second)
	ok, _, err := r.DeletionAllowed(ctx, e.sb, "k")
	require.NoError(t, err)
	l2, _ := r.Lease(ctx, e.sb, "k")
	require.True(t, ok, "the recheck after the outage verifies absence: %+v", l2)
	l, err = r.Lease(ctx, e.sb, "k")
	require.NoError(t, err)
	require.Equal(t, lease.None, l.State)
}
