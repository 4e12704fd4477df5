package fence_test

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

// crc16 is CRC16-CCITT (XMODEM), the hash of Redis Cluster key slots.
func crc16(b []byte) uint16 {
	var crc uint16
	for _, c := range b {
		crc ^= uint16(c) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

func slot(key string) uint16 { return crc16([]byte(fence.HashTag(key))) % 16384 }

func TestCRC16KnownValue(t *testing.T) {
	require.EqualValues(t, 0x31C3, crc16([]byte("123456789"))) // Redis cluster spec
	require.Equal(t, slot("{user1000}.following"), slot("{user1000}.followers"))
}

// Every script the package sends touches keys of one hash slot.
func TestAllScriptKeysShareOneSlot(t *testing.T) {
	rdb := redistest.Universal(t)
	counter := &commandCounter{}
	rdb.AddHook(counter)

	for _, res := range []string{"a", "sandbox/7f3e", "user:42:x", "with space"} {
		l, err := fence.Acquire(ctx, rdb, res, "o", time.Minute)
		require.NoError(t, err)
		require.NoError(t, l.Renew(ctx))
		require.NoError(t, l.Guard(ctx,
			fence.Set("sbx:"+fence.Key(res, "a"), 1, 0),
			fence.HSet(fence.Key(res, "b"), "f", 1),
			fence.PExpire(fence.Key(res, "b"), time.Minute),
			fence.Del(fence.Key(res, "c"), "ses:"+fence.Key(res, "d"))))
		require.NoError(t, l.Guard(ctx, fence.HSet(fence.Key(res, "b"), "g", 2))) // one-op script
		_, err = fence.NewGuardedScript(`return 1`).Run(ctx, rdb, res, l.Token, []string{fence.Key(res, "e")}).Result()
		require.NoError(t, err)
		require.NoError(t, l.Release(ctx))
		h, err := fence.Hold(ctx, rdb, res, "o", time.Minute)
		require.NoError(t, err)
		require.NoError(t, h.Release(ctx))
	}

	scripts := map[string]bool{}
	checked := 0
	for _, c := range counter.take() {
		name := c.Name()
		if name != "evalsha" && name != "eval" {
			continue
		}
		args := c.Args()
		if name == "evalsha" { // the first call of each script is an EVAL fallback
			scripts[args[1].(string)] = true
		}
		n := int(args[2].(int))
		require.Positive(t, n)
		want := slot(args[3].(string))
		for _, k := range args[3 : 3+n] {
			require.Equal(t, want, slot(k.(string)), "%v", args)
		}
		checked++
	}
	require.Positive(t, checked)
	// acquire, renew, release, the one-op and ops scripts and the custom
	// script.
	require.Len(t, scripts, 6)
}

// Issue 33 item 14: on a Redis Cluster, calls to the slots of a master that
// stopped answering (SIGSTOP: every call to it hangs until the client's
// timeouts) do not hold the batcher's lanes for calls to healthy slots: a
// guarded write on another master completes while every call to the
// stopped one is still waiting.
func TestAStoppedMasterDoesNotBlockHealthySlots(t *testing.T) {
	c := redistest.StartCluster(t)
	rdb := c.Client(t)
	require.EqualValues(t, slot("{x}:y"), fence.Slot("{x}:y"))
	stoppedRes, healthyRes := "", ""
	stopped, err := c.MasterOf(ctx, fence.TokenKey("r0"))
	require.NoError(t, err)
	for i := 0; stoppedRes == "" || healthyRes == ""; i++ {
		res := "r" + strconv.Itoa(i)
		m, err := c.MasterOf(ctx, fence.TokenKey(res))
		require.NoError(t, err)
		if m == stopped && stoppedRes == "" {
			stoppedRes = res
		} else if m != stopped && healthyRes == "" {
			healthyRes = res
		}
	}
	healthy, err := fence.Acquire(ctx, rdb, healthyRes, "o", time.Minute)
	require.NoError(t, err)
	stale, err := fence.Acquire(ctx, rdb, stoppedRes, "o", time.Minute)
	require.NoError(t, err)

	require.NoError(t, stopped.Pause())
	t.Cleanup(func() { _ = stopped.Resume() })
	const hung = 3 * fence.Lanes
	var returned atomic.Int64
	var wg sync.WaitGroup
	for range hung {
		wg.Go(func() {
			_ = stale.Guard(ctx, fence.Set(fence.Key(stoppedRes, "s"), "v", 0))
			returned.Add(1)
		})
	}
	// Every lane of the stopped master's calls is taken and the rest queue.
	require.Eventually(t, func() bool { return fence.QueuedForTest(rdb) >= hung-fence.Lanes },
		30*time.Second, time.Millisecond)
	require.NoError(t, healthy.Guard(ctx, fence.Set(fence.Key(healthyRes, "s"), "v", 0)))
	require.Zero(t, returned.Load(), "the healthy slot's write completed while the stopped master's calls still hang")
	require.NoError(t, stopped.Resume())
	wg.Wait()
}
