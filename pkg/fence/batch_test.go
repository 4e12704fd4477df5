package fence_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

// gate is a hook that holds the next single commands sent while it is
// armed, so a test can fill every lane and queue calls behind them, and
// records pipeline sizes.
type gate struct {
	mu        sync.Mutex
	hold      chan struct{} // closed to let the held commands go
	held      chan struct{} // one value per held command
	armed     int           // how many more commands to hold
	pipelines []int
}

func newGate() *gate { return &gate{hold: make(chan struct{}), held: make(chan struct{}, 64)} }

func (g *gate) DialHook(next redis.DialHook) redis.DialHook { return next }
func (g *gate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		g.mu.Lock()
		hold := g.armed > 0
		if hold {
			g.armed--
		}
		g.mu.Unlock()
		if hold {
			g.held <- struct{}{}
			<-g.hold
		}
		return next(ctx, cmd)
	}
}
func (g *gate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if cmds[0].Name() == "evalsha" { // not the connection's HELLO
			g.mu.Lock()
			g.pipelines = append(g.pipelines, len(cmds))
			g.mu.Unlock()
		}
		return next(ctx, cmds)
	}
}
func (g *gate) arm(n int) {
	g.mu.Lock()
	g.armed = n
	g.mu.Unlock()
}
func (g *gate) sizes() []int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]int(nil), g.pipelines...)
}

// gatedLease starts a Redis, a client with a gate and a lease on res.
func gatedLease(t *testing.T, res string) (*redis.Client, *gate, *fence.Lease) {
	t.Helper()
	// One node: the gate holds commands on that node's wire.
	rdb := redistest.Start(t).Client(t)
	g := newGate()
	rdb.AddHook(g)
	l, err := fence.Acquire(ctx, rdb, res, "o", time.Minute)
	require.NoError(t, err)
	return rdb, g, l
}

// holdOnTheWire runs call, plus renewals of l to fill the other lanes, and
// holds them all on the wire as single commands, so that further calls
// queue; let lets them go and returns the first error.
func holdOnTheWire(t *testing.T, g *gate, l *fence.Lease, call func() error) (let func() error) {
	t.Helper()
	g.arm(fence.Lanes)
	done := make(chan error, fence.Lanes)
	go func() { done <- call() }()
	for range fence.Lanes - 1 {
		go func() { done <- l.Renew(ctx) }()
	}
	for i := range fence.Lanes {
		select {
		case <-g.held:
		case <-time.After(30 * time.Second):
			t.Fatalf("only %d of %d lanes sent a call directly", i, fence.Lanes)
		}
	}
	return func() error {
		close(g.hold)
		var first error
		for range fence.Lanes {
			if err := <-done; err != nil && first == nil {
				first = err
			}
		}
		return first
	}
}

// Calls made while every lane is on the wire go out together in one
// pipeline, each with its own correct outcome; a lone call is sent alone.
func TestConcurrentCallsShareOnePipeline(t *testing.T) {
	rdb, g, first := gatedLease(t, "b0")
	require.Empty(t, g.sizes(), "a lone call is not pipelined")

	// Hold a guarded write on the wire, queue acquires behind it.
	let := holdOnTheWire(t, g, first, func() error { return first.Guard(ctx, fence.Set(fence.Key("b0", "k"), "v", 0)) })
	const n = 10
	leases := make([]*fence.Lease, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// "b0" is held: that one must fail as held, the others succeed.
			leases[i], errs[i] = fence.Acquire(ctx, rdb, "b"+strconv.Itoa(i), "o", time.Minute)
		}()
	}
	waitQueued(t, rdb, n)
	require.NoError(t, let())
	wg.Wait()

	require.ErrorIs(t, errs[0], fence.ErrLeaseHeld)
	for i := 1; i < n; i++ {
		require.NoError(t, errs[i], "acquire %d", i)
		require.Equal(t, "b"+strconv.Itoa(i), leases[i].Resource)
		require.NoError(t, leases[i].Release(ctx))
	}
	require.Equal(t, "v", rdb.Get(ctx, fence.Key("b0", "k")).Val())
	require.Equal(t, []int{n}, g.sizes(), "the queued calls go out as one pipeline")
}

// A pipeline that meets an empty script cache (Redis restarted, SCRIPT
// FLUSH) falls back to EVAL per call; nobody sees NOSCRIPT.
func TestPipelinedCallsSurviveScriptFlush(t *testing.T) {
	rdb, g, l := gatedLease(t, "f")
	require.NoError(t, rdb.ScriptFlush(ctx).Err())
	let := holdOnTheWire(t, g, l, func() error { return l.Renew(ctx) })
	const n = 8
	errs := make(chan error, n)
	for i := range n {
		go func() {
			errs <- l.Guard(ctx, fence.Set(fence.Key("f", "k"+strconv.Itoa(i)), "v", 0))
		}()
	}
	waitQueued(t, rdb, n)
	require.NoError(t, let())
	for range n {
		require.NoError(t, <-errs)
	}
	for i := range n {
		require.Equal(t, "v", rdb.Get(ctx, fence.Key("f", "k"+strconv.Itoa(i))).Val())
	}
}

// A queued call whose sender's context is cancelled still gets its result:
// the pipeline runs without the sender's cancellation.
func TestCancelledSenderDoesNotFailTheBatch(t *testing.T) {
	rdb, g, l := gatedLease(t, "c")
	let := holdOnTheWire(t, g, l, func() error { return l.Renew(ctx) })
	// The first queued call heads the next batch and sends it; its
	// context is cancelled before that.
	cctx, cancel := context.WithCancel(ctx)
	headErr := make(chan error, 1)
	go func() { headErr <- l.Guard(cctx, fence.Set(fence.Key("c", "head"), "v", 0)) }()
	waitQueued(t, rdb, 1)
	otherErr := make(chan error, 1)
	go func() { otherErr <- l.Guard(ctx, fence.Set(fence.Key("c", "other"), "v", 0)) }()
	waitQueued(t, rdb, 2)
	cancel()
	require.NoError(t, let())
	require.NoError(t, <-headErr)
	require.NoError(t, <-otherErr)
	require.Equal(t, "v", rdb.Get(ctx, fence.Key("c", "other")).Val())
}

// Many goroutines on one client, each cycling its own lease and writing
// under it, all succeed, and tokens per resource keep increasing.
func TestConcurrentCyclesOnOneClient(t *testing.T) {
	srv := redistest.Start(t)
	opt := srv.Options()
	opt.PoolSize = 16
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })
	const workers, cycles = 32, 50
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := "w" + strconv.Itoa(w)
			var last uint64
			for range cycles {
				l, err := fence.Acquire(ctx, rdb, res, "o", time.Minute)
				if err != nil {
					errs <- err
					return
				}
				if l.Token <= last {
					errs <- fence.ErrStaleToken
					return
				}
				last = l.Token
				if err := l.Guard(ctx, fence.Set(fence.Key(res, "k"), l.Token, 0)); err != nil {
					errs <- err
					return
				}
				if err := l.Release(ctx); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

func waitQueued(t *testing.T, rdb *redis.Client, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return fence.QueuedForTest(rdb) == n },
		30*time.Second, time.Millisecond, "%d calls never queued", n)
}
