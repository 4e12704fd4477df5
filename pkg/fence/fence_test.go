package fence_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

func TestMain(m *testing.M) {
	// The test binary doubles as the helper process of the multi-process
	// tests (see process_test.go).
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(runHelper(mode))
	}
	goleak.VerifyTestMain(redistest.Shared(m))
}

var ctx = context.Background()

// waitGone polls until key has expired. The bound only turns a hang into a
// failure; it asserts nothing about timing.
func waitGone(t testing.TB, rdb redis.UniversalClient, key string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for rdb.Exists(ctx, key).Val() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not expire", key)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestTokensStrictlyIncrease(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const res = "mono"
	var last uint64
	next := func(ttl time.Duration) *fence.Lease {
		t.Helper()
		l, err := fence.Acquire(ctx, rdb, res, "a", ttl)
		require.NoError(t, err)
		require.Greater(t, l.Token, last)
		last = l.Token
		return l
	}

	for range 20 { // normal acquire and release
		require.NoError(t, next(time.Minute).Release(ctx))
	}
	for range 5 { // lease expiry
		next(20 * time.Millisecond)
		waitGone(t, rdb, fence.LeaseKey(res))
	}
	for range 5 { // FLUSHALL loses the counter; the TIME floor remains
		next(time.Minute)
		require.NoError(t, redistest.FlushAll(ctx, rdb))
	}
	for range 3 { // restart without persistence
		next(time.Minute)
		srv.Restart(t, redistest.DropData)
	}
	for range 2 { // restart with persistence keeps the lease
		l := next(time.Minute)
		srv.Restart(t, redistest.KeepData)
		require.NoError(t, l.Renew(ctx))
		require.NoError(t, l.Release(ctx))
	}
	next(time.Minute)
}

// A token key set far ahead of TIME (e.g. restored from a snapshot taken on
// a server with a faster clock) still only moves forward.
func TestTokenCounterAboveTimeFloor(t *testing.T) {
	rdb := redistest.Universal(t)
	future := uint64(time.Now().Add(24*time.Hour).UnixMicro()) + 12345
	require.NoError(t, rdb.Set(ctx, fence.TokenKey("r"), future, 0).Err())
	l, err := fence.Acquire(ctx, rdb, "r", "a", time.Minute)
	require.NoError(t, err)
	require.Equal(t, future+1, l.Token)
}

// The acquire script compares canonical decimal tokens as strings and
// parses only a stored token that is not clearly below TIME. Whatever is
// stored, the granted token is canonical, at least the TIME floor, and
// written back to the token key; a malformed token counts as absent.
func TestAcquireStoredTokenForms(t *testing.T) {
	rdb := redistest.Universal(t)
	floor := uint64(time.Now().Add(-time.Hour).UnixMicro())
	for i, stored := range []string{"", "5", "garbage", "9e99", "0x1", "99999999999999999999999x", "1700000000abcdef"} {
		res := "forms-" + strconv.Itoa(i)
		require.NoError(t, rdb.Set(ctx, fence.TokenKey(res), stored, 0).Err())
		l, err := fence.Acquire(ctx, rdb, res, "a", time.Minute)
		require.NoError(t, err, "stored %q", stored)
		require.Greater(t, l.Token, floor, "stored %q", stored)
		require.Less(t, l.Token, uint64(1)<<53, "stored %q", stored)
		require.Equal(t, strconv.FormatUint(l.Token, 10), rdb.Get(ctx, fence.TokenKey(res)).Val())
		require.Equal(t, strconv.FormatUint(l.Token, 10)+":a", rdb.Get(ctx, fence.LeaseKey(res)).Val())
	}
	// Canonical tokens ahead of TIME, longer and of equal length, still
	// only move forward by one.
	for i, ahead := range []uint64{uint64(time.Now().Add(time.Hour).UnixMicro()), 12345678901234567} {
		res := "ahead-" + strconv.Itoa(i)
		require.NoError(t, rdb.Set(ctx, fence.TokenKey(res), ahead, 0).Err())
		l, err := fence.Acquire(ctx, rdb, res, "a", time.Minute)
		require.NoError(t, err)
		require.Equal(t, ahead+1, l.Token)
		require.Equal(t, strconv.FormatUint(ahead+1, 10)+":a", rdb.Get(ctx, fence.LeaseKey(res)).Val())
	}
}

func TestConcurrentGoroutinesOneHolderPerPeriod(t *testing.T) {
	rdb := redistest.Universal(t)
	const res, workers, rounds = "race", 16, 30
	var last uint64
	for round := range rounds {
		var wins atomic.Int32
		var winner *fence.Lease
		var wg sync.WaitGroup
		start := make(chan struct{})
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				l, err := fence.Acquire(ctx, rdb, res, "w"+strconv.Itoa(w), 100*time.Millisecond)
				if errors.Is(err, fence.ErrLeaseHeld) {
					return
				}
				if err != nil {
					t.Error(err)
					return
				}
				wins.Add(1)
				winner = l
			}()
		}
		close(start)
		wg.Wait()
		require.EqualValues(t, 1, wins.Load(), "round %d", round)
		require.Greater(t, winner.Token, last)
		last = winner.Token
		if round%2 == 0 {
			require.NoError(t, winner.Release(ctx))
		} else {
			waitGone(t, rdb, fence.LeaseKey(res)) // next period by expiry
		}
	}
}

func TestRenewAndReleaseSemantics(t *testing.T) {
	rdb := redistest.Universal(t)
	lk := fence.LeaseKey("r")

	t.Run("renew extends", func(t *testing.T) {
		a, err := fence.Acquire(ctx, rdb, "r", "a", 200*time.Millisecond)
		require.NoError(t, err)
		a.TTL = time.Minute
		require.NoError(t, a.Renew(ctx))
		require.Greater(t, rdb.PTTL(ctx, lk).Val(), 30*time.Second)
		require.NoError(t, a.Release(ctx))
		require.Zero(t, rdb.Exists(ctx, lk).Val())
		require.ErrorIs(t, a.Release(ctx), fence.ErrLeaseLost)
		require.ErrorIs(t, a.Renew(ctx), fence.ErrLeaseLost)
		require.Zero(t, rdb.Exists(ctx, lk).Val(), "renew must not recreate a lease")
	})
	t.Run("expired lease is never recreated", func(t *testing.T) {
		a, err := fence.Acquire(ctx, rdb, "r", "a", 20*time.Millisecond)
		require.NoError(t, err)
		waitGone(t, rdb, lk)
		require.ErrorIs(t, a.Renew(ctx), fence.ErrLeaseLost)
		require.Zero(t, rdb.Exists(ctx, lk).Val())
		require.ErrorIs(t, a.Release(ctx), fence.ErrLeaseLost)
	})
	t.Run("taken over", func(t *testing.T) {
		a, err := fence.Acquire(ctx, rdb, "r", "a", 20*time.Millisecond)
		require.NoError(t, err)
		waitGone(t, rdb, lk)
		b, err := fence.Acquire(ctx, rdb, "r", "b", time.Minute)
		require.NoError(t, err)
		before := rdb.Get(ctx, lk).Val()
		require.ErrorIs(t, a.Renew(ctx), fence.ErrLeaseLost)
		require.ErrorIs(t, a.Release(ctx), fence.ErrLeaseLost)
		require.Equal(t, before, rdb.Get(ctx, lk).Val(), "a must not touch b's lease")

		// Same owner name with an old token, and b's token with another
		// owner name: neither may release b's lease.
		old := *a
		old.Owner = "b"
		require.ErrorIs(t, old.Release(ctx), fence.ErrLeaseLost)
		forged := *b
		forged.Owner = "mallory"
		require.ErrorIs(t, forged.Release(ctx), fence.ErrLeaseLost)
		require.ErrorIs(t, forged.Renew(ctx), fence.ErrLeaseLost)
		require.Equal(t, before, rdb.Get(ctx, lk).Val())

		_, err = fence.Acquire(ctx, rdb, "r", "c", time.Minute)
		require.ErrorIs(t, err, fence.ErrLeaseHeld)
		require.NoError(t, b.Release(ctx))
	})
}

func TestValidation(t *testing.T) {
	rdb := redistest.Universal(t)
	for _, r := range []string{"", "a{b", "a}b", "{x}"} {
		_, err := fence.Acquire(ctx, rdb, r, "o", time.Second)
		require.ErrorIs(t, err, fence.ErrInvalid, r)
	}
	_, err := fence.Acquire(ctx, rdb, "r", "", time.Second)
	require.ErrorIs(t, err, fence.ErrInvalid)
	_, err = fence.Acquire(ctx, rdb, "r", "o", 0)
	require.ErrorIs(t, err, fence.ErrInvalid)
	require.ErrorIs(t, fence.Guard(ctx, rdb, "r", 1, fence.Set("other:{x}:k", "v", 0)), fence.ErrInvalid)
	require.ErrorIs(t, fence.Guard(ctx, rdb, "r", 1, fence.Set("no-tag", "v", 0)), fence.ErrInvalid)
	require.ErrorIs(t, fence.Guard(ctx, rdb, "r", 1), fence.ErrInvalid)
}

// commandCounter is a go-redis hook counting commands sent to Redis
// (pipelines count each command).
type commandCounter struct {
	mu   sync.Mutex
	cmds []redis.Cmder
}

func (c *commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.mu.Lock()
		c.cmds = append(c.cmds, cmd)
		c.mu.Unlock()
		return next(ctx, cmd)
	}
}
func (c *commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.mu.Lock()
		c.cmds = append(c.cmds, cmds...)
		c.mu.Unlock()
		return next(ctx, cmds)
	}
}
func (c *commandCounter) take() []redis.Cmder {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.cmds
	c.cmds = nil
	return out
}

func TestGuardedWrite(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	counter := &commandCounter{}
	rdb.AddHook(counter)
	const res = "g"
	k, h := fence.Key(res, "state"), fence.Key(res, "hash")

	a, err := fence.Acquire(ctx, rdb, res, "a", time.Minute)
	require.NoError(t, err)
	// Load both scripts (one op, several ops).
	require.NoError(t, a.Guard(ctx, fence.Set(k, "a0", 0)))
	require.NoError(t, a.Guard(ctx, fence.Set(k, "a0", 0), fence.HSet(h, "f", "0")))
	counter.take()

	require.NoError(t, a.Guard(ctx, fence.Set(k, "a1", 0)))
	cmds := counter.take()
	require.Len(t, cmds, 1, "a guarded write is one round trip")
	require.Equal(t, "evalsha", cmds[0].Name())
	require.Equal(t, "a1", rdb.Get(ctx, k).Val())
	counter.take()

	require.NoError(t, a.Guard(ctx, fence.Set(k, "a2", time.Minute), fence.HSet(h, "f", "1", "g", "2")))
	cmds = counter.take()
	require.Len(t, cmds, 1, "a guarded write is one round trip")
	require.Equal(t, "evalsha", cmds[0].Name())
	require.Equal(t, "a2", rdb.Get(ctx, k).Val())
	require.Equal(t, map[string]string{"f": "1", "g": "2"}, rdb.HGetAll(ctx, h).Val())

	require.NoError(t, a.Release(ctx))
	b, err := fence.Acquire(ctx, rdb, res, "b", time.Minute)
	require.NoError(t, err)

	// a's token is older than b's: rejected, nothing changes.
	counter.take()
	err = a.Guard(ctx, fence.Set(k, "stale", 0), fence.Del(h))
	require.ErrorIs(t, err, fence.ErrStaleToken)
	require.Len(t, counter.take(), 1)
	require.Equal(t, "a2", rdb.Get(ctx, k).Val())
	require.EqualValues(t, 1, rdb.Exists(ctx, h).Val())

	require.NoError(t, b.Guard(ctx, fence.Del(h), fence.PExpire(k, time.Minute)))
	require.Zero(t, rdb.Exists(ctx, h).Val())

	// Zero token fails closed without a round trip.
	counter.take()
	require.ErrorIs(t, fence.Guard(ctx, rdb, res, 0, fence.Set(k, "zero", 0)), fence.ErrStaleToken)
	require.Empty(t, counter.take())
	// A token newer than any granted is not accepted either.
	require.ErrorIs(t, fence.Guard(ctx, rdb, res, b.Token+1, fence.Set(k, "future", 0)), fence.ErrStaleToken)

	// Token key lost (FLUSHALL, restart without persistence): b's token is
	// unknown, so its writes fail closed.
	srv.Restart(t, redistest.DropData)
	require.ErrorIs(t, b.Guard(ctx, fence.Set(k, "after-restart", 0)), fence.ErrStaleToken)
	require.ErrorIs(t, rdb.Get(ctx, k).Err(), redis.Nil)
}

// Each single op takes the one-op script; a stale token still writes
// nothing, whatever the op.
func TestGuardedSingleOps(t *testing.T) {
	rdb := redistest.Universal(t)
	const res = "one"
	k, h := fence.Key(res, "k"), fence.Key(res, "h")
	a, err := fence.Acquire(ctx, rdb, res, "a", time.Minute)
	require.NoError(t, err)

	require.NoError(t, a.Guard(ctx, fence.Set(k, "v1", time.Minute)))
	require.Equal(t, "v1", rdb.Get(ctx, k).Val())
	require.Positive(t, rdb.PTTL(ctx, k).Val())
	require.NoError(t, a.Guard(ctx, fence.Set(k, "v2", 0)))
	require.Equal(t, time.Duration(-1), rdb.PTTL(ctx, k).Val(), "SET without PX clears the TTL")
	require.NoError(t, a.Guard(ctx, fence.HSet(h, "f", "1", "g", "2")))
	require.Equal(t, map[string]string{"f": "1", "g": "2"}, rdb.HGetAll(ctx, h).Val())
	require.NoError(t, a.Guard(ctx, fence.PExpire(h, time.Minute)))
	require.Positive(t, rdb.PTTL(ctx, h).Val())

	require.NoError(t, a.Release(ctx))
	b, err := fence.Acquire(ctx, rdb, res, "b", time.Minute)
	require.NoError(t, err)
	for _, op := range []fence.Op{fence.Set(k, "stale", 0), fence.HSet(h, "f", "stale"), fence.Del(k), fence.PExpire(h, time.Millisecond)} {
		require.ErrorIs(t, a.Guard(ctx, op), fence.ErrStaleToken)
	}
	require.Equal(t, "v2", rdb.Get(ctx, k).Val())
	require.Equal(t, "1", rdb.HGet(ctx, h, "f").Val())
	require.Greater(t, rdb.PTTL(ctx, h).Val(), time.Second)

	require.NoError(t, b.Guard(ctx, fence.Del(k)))
	require.Zero(t, rdb.Exists(ctx, k).Val())
}

// A token key of the wrong type makes acquire fail without leaving a lease
// behind.
func TestAcquireTokenKeyWrongType(t *testing.T) {
	rdb := redistest.Universal(t)
	require.NoError(t, rdb.HSet(ctx, fence.TokenKey("w"), "f", "1").Err())
	_, err := fence.Acquire(ctx, rdb, "w", "a", time.Minute)
	require.ErrorContains(t, err, "WRONGTYPE")
	require.Zero(t, rdb.Exists(ctx, fence.LeaseKey("w")).Val())
}

func TestGuardedScriptMalformedTokens(t *testing.T) {
	rdb := redistest.Universal(t)
	l, err := fence.Acquire(ctx, rdb, "m", "a", time.Minute)
	require.NoError(t, err)
	k := fence.Key("m", "v")

	script := fence.NewGuardedScript(`redis.call('SET', KEYS[2], ARGV[2]); return ARGV[2]`)
	v, err := script.Run(ctx, rdb, "m", l.Token, []string{k}, "ok").Text()
	require.NoError(t, err)
	require.Equal(t, "ok", v)

	// Raw script calls with malformed tokens, bypassing the Go API: the Lua
	// check itself must fail closed.
	src := fence.GuardPreludeForTest + `redis.call('SET', KEYS[2], 'bad') return 1`
	tok := strconv.FormatUint(l.Token, 10)
	for _, bad := range []string{"", "0", "abc", "0" + tok, tok + ".0", " " + tok, tok + " ", fmt.Sprintf("%e", float64(l.Token)), "-1"} {
		err := rdb.Eval(ctx, src, []string{fence.TokenKey("m"), k}, bad).Err()
		require.ErrorContains(t, err, "FENCE_STALE", "token %q", bad)
	}
	require.Equal(t, "ok", rdb.Get(ctx, k).Val())
	// Missing token key.
	require.NoError(t, rdb.Del(ctx, fence.TokenKey("m")).Err())
	require.ErrorIs(t, script.Run(ctx, rdb, "m", l.Token, []string{k}, "x").Err(), fence.ErrStaleToken)
	require.Equal(t, "ok", rdb.Get(ctx, k).Val())
}

// The paused-holder scenario, in process: A stops renewing ("paused") past
// its TTL, B acquires and writes, A wakes up and writes: rejected.
func TestPausedHolderInProcess(t *testing.T) {
	rdb := redistest.Universal(t)
	const iterations = 250
	accepted := 0
	for i := range iterations {
		res := "p" + strconv.Itoa(i%7)
		k := fence.Key(res, "state")
		a, err := fence.Acquire(ctx, rdb, res, "A", 10*time.Millisecond)
		require.NoError(t, err)
		require.NoError(t, a.Guard(ctx, fence.Set(k, "A", 0)))
		waitGone(t, rdb, fence.LeaseKey(res)) // A is paused past its TTL
		b, err := fence.Acquire(ctx, rdb, res, "B", time.Minute)
		require.NoError(t, err)
		require.NoError(t, b.Guard(ctx, fence.Set(k, "B", 0)))
		if err := a.Guard(ctx, fence.Set(k, "A-stale", 0)); !errors.Is(err, fence.ErrStaleToken) {
			accepted++
		}
		require.Equal(t, "B", rdb.Get(ctx, k).Val())
		require.NoError(t, b.Release(ctx))
	}
	require.Zero(t, accepted, "stale writes accepted")
}

func TestHolderRenewsAndReleases(t *testing.T) {
	rdb := redistest.Universal(t)
	counter := &commandCounter{}
	rdb.AddHook(counter)
	h, err := fence.Hold(ctx, rdb, "h", "a", 90*time.Millisecond)
	require.NoError(t, err)
	// Survive several TTLs only by renewing.
	time.Sleep(400 * time.Millisecond)
	select {
	case <-h.Done():
		t.Fatalf("lease lost: %v", h.Err())
	default:
	}
	renews := 0
	for _, c := range counter.take() {
		if c.Name() == "evalsha" || c.Name() == "eval" {
			renews++
		}
	}
	require.GreaterOrEqual(t, renews, 4, "renewal at ttl/3")
	require.NoError(t, h.Guard(ctx, fence.Set(fence.Key("h", "s"), "v", 0)))
	require.NoError(t, h.Release(ctx))
	<-h.Done()
	require.NoError(t, h.Err())
	require.Zero(t, rdb.Exists(ctx, fence.LeaseKey("h")).Val())
}

func waitDone(t *testing.T, h *fence.Holder) {
	t.Helper()
	select {
	case <-h.Done():
		require.ErrorIs(t, h.Err(), fence.ErrLeaseLost)
	case <-time.After(10 * time.Second):
		t.Fatal("Done did not close")
	}
}

func TestHolderDoneOnLoss(t *testing.T) {
	t.Run("lease deleted", func(t *testing.T) {
		rdb := redistest.Universal(t)
		h, err := fence.Hold(ctx, rdb, "h", "a", 150*time.Millisecond)
		require.NoError(t, err)
		require.NoError(t, rdb.Del(ctx, fence.LeaseKey("h")).Err())
		waitDone(t, h)
		require.ErrorIs(t, h.Release(ctx), fence.ErrLeaseLost)
	})
	t.Run("taken over after flush", func(t *testing.T) {
		rdb := redistest.Universal(t)
		h, err := fence.Hold(ctx, rdb, "h", "a", 150*time.Millisecond)
		require.NoError(t, err)
		require.NoError(t, redistest.FlushAll(ctx, rdb))
		_, err = fence.Acquire(ctx, rdb, "h", "b", time.Minute)
		require.NoError(t, err)
		waitDone(t, h)
		require.ErrorIs(t, h.Guard(ctx, fence.Set(fence.Key("h", "s"), "v", 0)), fence.ErrStaleToken)
	})
	t.Run("redis killed", func(t *testing.T) {
		srv := redistest.Start(t)
		rdb := srv.Client(t)
		h, err := fence.Hold(ctx, rdb, "h", "a", 150*time.Millisecond)
		require.NoError(t, err)
		require.NoError(t, srv.Kill())
		waitDone(t, h)
		require.ErrorIs(t, h.Release(ctx), fence.ErrLeaseLost)
	})
	t.Run("redis paused", func(t *testing.T) {
		srv := redistest.Start(t)
		rdb := srv.Client(t)
		h, err := fence.Hold(ctx, rdb, "h", "a", 150*time.Millisecond)
		require.NoError(t, err)
		require.NoError(t, srv.Pause())
		// The renewal hangs; the holder gives up after 5 TTLs unconfirmed.
		waitDone(t, h)
		require.NoError(t, srv.Resume())
		require.ErrorIs(t, h.Release(ctx), fence.ErrLeaseLost)
	})
}

// A lease that survives a Redis restart (or failover) stays held: the
// renewals Redis could not answer are retried within the lease's deadline.
func TestHolderKeepsALeaseThatSurvivesRedis(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const ttl = 6 * time.Second
	h, err := fence.Hold(ctx, rdb, "h", "a", ttl)
	require.NoError(t, err)
	// Down across a renewal (every ttl/3) and go-redis' own retries of it,
	// well within the ttl, with the lease saved.
	require.NoError(t, rdb.Save(ctx).Err())
	require.NoError(t, srv.Kill())
	time.Sleep(ttl * 2 / 3)
	srv.Start(t)
	require.Eventually(t, func() bool { // a renewal after the restart
		return rdb.PTTL(ctx, fence.LeaseKey("h")).Val() > ttl*9/10
	}, 2*ttl, 10*time.Millisecond)
	select {
	case <-h.Done():
		t.Fatalf("lease given up across the restart: %v", h.Err())
	default:
	}
	require.NoError(t, h.Release(ctx))
}

// A Lease caches its keys and token string; a copy whose exported fields
// were changed must act on the changed fields, never on the cache.
func TestLeaseCopyWithChangedFields(t *testing.T) {
	rdb := redistest.Universal(t)
	a, err := fence.Acquire(ctx, rdb, "c1", "a", time.Minute)
	require.NoError(t, err)
	b, err := fence.Acquire(ctx, rdb, "c2", "b", time.Minute)
	require.NoError(t, err)

	moved := *a
	moved.Resource, moved.Token, moved.Owner = "c2", b.Token, "b"
	require.NoError(t, moved.Guard(ctx, fence.Set(fence.Key("c2", "v"), "x", 0)))
	require.NoError(t, moved.Renew(ctx))

	older := *b
	older.Token--
	require.ErrorIs(t, older.Guard(ctx, fence.Set(fence.Key("c2", "v"), "stale", 0)), fence.ErrStaleToken)
	require.ErrorIs(t, older.Release(ctx), fence.ErrLeaseLost)
	require.Equal(t, "x", rdb.Get(ctx, fence.Key("c2", "v")).Val())
	require.NoError(t, moved.Release(ctx))
	require.ErrorIs(t, b.Release(ctx), fence.ErrLeaseLost)
	require.NoError(t, a.Release(ctx))
}

// Issue 33 item 5: a renewal that could not be confirmed is not a lease
// lost. Redis paused past the lease's deadline: the holder reads
// Unconfirmed but keeps the lease (Done stays open); once Redis answers, the
// lease, expired meanwhile and granted to nobody, is reclaimed with the same
// token and the holder's guarded writes pass again. Another owner granted
// the lease meanwhile is a loss.
func TestUnconfirmedIsNotLost(t *testing.T) {
	t.Run("reclaimed after the deadline", func(t *testing.T) {
		srv := redistest.Start(t)
		rdb := srv.Client(t)
		h, err := fence.Hold(ctx, rdb, "u", "a", 2*time.Second)
		require.NoError(t, err)
		require.False(t, h.Unconfirmed())
		require.NoError(t, srv.Pause())
		require.Eventually(t, h.Unconfirmed, 30*time.Second, 5*time.Millisecond, "past the deadline without a confirmed renewal")
		require.NoError(t, srv.Resume())
		require.Eventually(t, func() bool { return !h.Unconfirmed() }, 30*time.Second, 5*time.Millisecond, "a renewal is confirmed again")
		select {
		case <-h.Done():
			t.Fatalf("an unconfirmed lease was given up: %v", h.Err())
		default:
		}
		require.Equal(t, strconv.FormatUint(h.Token(), 10)+":a", rdb.Get(ctx, fence.LeaseKey("u")).Val(), "held with the same token")
		require.NoError(t, h.Guard(ctx, fence.Set(fence.Key("u", "s"), "v", 0)))
		require.NoError(t, h.Release(ctx))
	})
	t.Run("granted to another meanwhile", func(t *testing.T) {
		srv := redistest.Start(t)
		rdb := srv.Client(t)
		h, err := fence.Hold(ctx, rdb, "u", "a", 2*time.Second)
		require.NoError(t, err)
		require.NoError(t, srv.Pause())
		require.Eventually(t, h.Unconfirmed, 30*time.Second, 5*time.Millisecond)
		require.NoError(t, srv.Resume())
		// Another client is granted the lease first: delete it as an
		// expiry would, and acquire.
		// a's reclaim may come between the delete and the acquire: then
		// delete again (never skip: the case must run).
		other := srv.Client(t)
		require.Eventually(t, func() bool {
			require.NoError(t, other.Del(ctx, fence.LeaseKey("u")).Err())
			_, err := fence.Acquire(ctx, other, "u", "b", time.Minute)
			if err != nil {
				require.ErrorIs(t, err, fence.ErrLeaseHeld)
			}
			return err == nil
		}, 30*time.Second, 10*time.Millisecond, "b is granted the lease")
		waitDone(t, h)
	})
}
