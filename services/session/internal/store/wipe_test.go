package store

import (
	"context"
	"encoding/json"
	"runtime"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/session/internal/session"
)

const wipeEvents = 1_000_000

// loadSession stores a session record, an intent and n events (pipelined
// XADD, 10k per round trip).
func loadSession(tb testing.TB, ctx context.Context, s *Store, id string, n int) *session.DeletionIntent {
	tb.Helper()
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	sess := &session.Session{ID: id, OrgID: "o", UserID: "u", SandboxID: "sbx", Directory: "/w", CreateTime: now}
	_, _, err := s.Create(ctx, sess, func(*session.Session) error { return nil })
	require.NoError(tb, err)
	in := session.NewDeletionIntent(sess, "client", now)
	raw, _ := json.Marshal(&in)
	require.NoError(tb, s.rdb.Set(ctx, key(id, "del"), raw, 0).Err())
	payload := make([]byte, 64)
	for done := 0; done < n; {
		p := s.rdb.Pipeline()
		for i := 0; i < 10_000 && done < n; i++ {
			p.XAdd(ctx, redisXAdd{key(id, "events")}.args(payload))
			done++
		}
		_, err := p.Exec(ctx)
		require.NoError(tb, err)
	}
	require.NoError(tb, s.rdb.HSet(ctx, key(id, "msgs"), "m1", `{}`).Err())
	return &in
}

// TestWipeOfAMillionEventsStaysSmall wipes a session with 1,000,000 stored
// events and checks that the service's heap grows by less than 64 MiB: the
// wipe works on key names only (SCAN + UNLINK) and never loads a value.
func TestWipeOfAMillionEventsStaysSmall(t *testing.T) {
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	ctx := context.Background()
	s := New(rdb, 2_000_000, noDeadline)
	in := loadSession(t, ctx, s, "big", wipeEvents)
	require.EqualValues(t, wipeEvents, rdb.XLen(ctx, key("big", "events")).Val())

	lease, err := s.DeletionLease(ctx, "big", "test", time.Minute)
	require.NoError(t, err)
	growth, allocated := measureHeap(func() {
		require.NoError(t, s.Wipe(ctx, lease, in, WipeLocator{SandboxID: "sbx", Directory: "/w"}, 0))
	})
	t.Logf("wipe of %d events: heap growth %d B, total allocated %d B", wipeEvents, growth, allocated)
	require.Less(t, growth, int64(64<<20))
	require.Less(t, allocated, uint64(64<<20), "even cumulative allocation stays under the bound")
	keys, err := rdb.Keys(ctx, "ses:{ses/big}:*").Result()
	require.NoError(t, err)
	require.Empty(t, keys)
	require.Equal(t, "sbx", rdb.HGet(ctx, WipeLocatorKey("big"), "sandbox_id").Val())
}

// measureHeap returns the live-heap growth and the bytes allocated while fn ran.
func measureHeap(fn func()) (growth int64, allocated uint64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fn()
	runtime.ReadMemStats(&after)
	return int64(after.HeapAlloc) - int64(before.HeapAlloc), after.TotalAlloc - before.TotalAlloc
}

// TestWipeLeavesOnlyAnExpiringLocator (issue 32): after the wipe the only
// key of the session is its wipe locator, with a TTL; the session's fencing
// token goes too, and a repeated deletion does not write it again.
func TestWipeLeavesOnlyAnExpiringLocator(t *testing.T) {
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	ctx := context.Background()
	s := New(rdb, 1000, noDeadline)
	in := loadSession(t, ctx, s, "w", 10)
	lease, err := s.DeletionLease(ctx, "w", "test", time.Minute)
	require.NoError(t, err)
	require.NoError(t, s.Wipe(ctx, lease, in, WipeLocator{SandboxID: "sbx", Directory: "/w"}, time.Hour))
	require.NoError(t, lease.Release(ctx))
	keys, err := rdb.Keys(ctx, "*{ses/w}*").Result()
	require.NoError(t, err)
	require.Equal(t, []string{WipeLocatorKey("w")}, keys)
	ttl := rdb.PTTL(ctx, WipeLocatorKey("w")).Val()
	require.Positive(t, ttl)
	require.LessOrEqual(t, ttl, time.Hour)
	gone, err := s.Gone(ctx, "w")
	require.NoError(t, err)
	require.True(t, gone)
}

func TestWipeIsFenced(t *testing.T) {
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	ctx := context.Background()
	s := New(rdb, 1000, noDeadline)
	in := loadSession(t, ctx, s, "f", 10)
	old, err := s.DeletionLease(ctx, "f", "a", time.Minute)
	require.NoError(t, err)
	require.NoError(t, old.Release(ctx))
	_, err = s.DeletionLease(ctx, "f", "b", time.Minute)
	require.NoError(t, err)
	require.Error(t, s.Wipe(ctx, old, in, WipeLocator{}, 0), "a deposed reconciler cannot wipe")
	require.EqualValues(t, 1, rdb.Exists(ctx, key("f", "meta")).Val())
}

type redisXAdd struct{ stream string }

func (x redisXAdd) args(payload []byte) *redis.XAddArgs {
	return &redis.XAddArgs{Stream: x.stream, Values: []any{"k", "runtime", "t", 0, "v", payload}}
}

func noDeadline(*session.Aggregate) time.Time { return time.Time{} }
