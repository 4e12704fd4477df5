package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/ingest/internal/history"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(redistest.Shared(m)) }

func newStore(t *testing.T) (*Store, redis.UniversalClient) {
	t.Helper()
	rdb := redistest.Universal(t)
	return New(rdb), rdb
}

func item(id string, version uint64) history.Item {
	return history.Item{
		ID: id, Type: history.TypePart, Version: version, ParentID: "msg",
		// The content is a function of (id, version): a version is immutable.
		Payload: fmt.Appendf(nil, `{"id":%q,"v":%d}`, id, version),
		Time:    time.Unix(1700000000, int64(version)).UTC(),
	}
}

func TestVersionCompareBeyondFloatPrecision(t *testing.T) {
	s, _ := newStore(t)
	ctx := context.Background()
	// 2^53 and 2^53+1 are the same Lua number; the string compare must still order them.
	big := uint64(1) << 53
	_, err := s.Ingest(ctx, "rs", []history.Item{item("a", big+1)})
	require.NoError(t, err)
	res, err := s.Ingest(ctx, "rs", []history.Item{item("a", big)})
	require.NoError(t, err)
	require.Equal(t, 1, res.Ignored)
	res, err = s.Ingest(ctx, "rs", []history.Item{item("a", math.MaxUint64)})
	require.NoError(t, err)
	require.Equal(t, 1, res.Applied)
	items, _, _, err := s.Export(ctx, "rs", Page{})
	require.NoError(t, err)
	require.Equal(t, []history.Item{item("a", math.MaxUint64)}, items)
}

func TestBatchResultCountsAndDuplicatesInOneBatch(t *testing.T) {
	s, rdb := newStore(t)
	ctx := context.Background()
	res, err := s.Ingest(ctx, "rs", []history.Item{item("a", 2), item("a", 1), item("a", 2), item("a", 3), item("b", 1)})
	require.NoError(t, err)
	require.Equal(t, history.BatchResult{Applied: 3, Ignored: 2, Cursor: res.Cursor}, res)
	entries := rdb.XRange(ctx, streamKey("rs"), "-", "+").Val()
	require.Len(t, entries, 1, "one stream entry per batch")
	require.Equal(t, entries[0].ID+"-2", res.Cursor)
	inEntry, err := decodeEntry(entries[0])
	require.NoError(t, err)
	require.Equal(t, []history.Item{item("a", 2), item("a", 3), item("b", 1)}, inEntry)
	items, cursor, _, err := s.Export(ctx, "rs", Page{})
	require.NoError(t, err)
	require.Equal(t, []history.Item{item("a", 3), item("b", 1)}, items)
	require.Equal(t, res.Cursor, cursor)

	// A batch of nothing new writes no entry.
	res, err = s.Ingest(ctx, "rs", []history.Item{item("a", 1), item("b", 1)})
	require.NoError(t, err)
	require.Equal(t, history.BatchResult{Ignored: 2}, res)
	require.Equal(t, int64(1), rdb.XLen(ctx, streamKey("rs")).Val())
}

// TestReplayProperty: replaying any set of batches any number of times, in any order, yields
// the same export: for every item, the newest version ever sent. Seeded, many iterations.
func TestReplayProperty(t *testing.T) {
	s, rdb := newStore(t)
	ctx := context.Background()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	const iterations = 300
	for iter := range iterations {
		id := fmt.Sprintf("rs-%d", iter)
		// A set of batches over a few items and versions.
		batches := make([][]history.Item, 1+rng.IntN(6))
		newest := map[string]uint64{}
		for b := range batches {
			for range 1 + rng.IntN(8) {
				it := item(fmt.Sprintf("i%d", rng.IntN(5)), 1+rng.Uint64N(6))
				batches[b] = append(batches[b], it)
				newest[it.ID] = max(newest[it.ID], it.Version)
			}
		}
		var want []history.Item
		for _, name := range []string{"i0", "i1", "i2", "i3", "i4"} {
			if v, ok := newest[name]; ok {
				want = append(want, item(name, v))
			}
		}
		// Replay: every batch at least once, some many times, in a random order.
		var plan []int
		for b := range batches {
			for range 1 + rng.IntN(3) {
				plan = append(plan, b)
			}
		}
		rng.Shuffle(len(plan), func(i, j int) { plan[i], plan[j] = plan[j], plan[i] })
		for _, b := range plan {
			_, err := s.Ingest(ctx, id, batches[b])
			require.NoError(t, err)
		}
		got, cursor, _, err := s.Export(ctx, id, Page{})
		require.NoError(t, err)
		require.Equal(t, want, got, "seed %d iteration %d plan %v", seed, iter, plan)

		// The stream holds each item's versions in strictly increasing order, ending at the
		// newest, and the export cursor is its last entry.
		seen := map[string]uint64{}
		var lastCursor string
		requireDone(t, s.Tail(ctx, id, "", func(e history.Entry) error {
			require.Greater(t, e.Item.Version, seen[e.Item.ID])
			seen[e.Item.ID] = e.Item.Version
			lastCursor = e.Cursor
			if e.Cursor == cursor {
				return errDone
			}
			return nil
		}))
		require.Equal(t, newest, seen)
		require.Equal(t, lastCursor, cursor)
		_ = rdb
	}
}

func TestTailResumeFollowAndDelete(t *testing.T) {
	s, _ := newStore(t)
	s.TailBlock = 50 * time.Millisecond
	ctx := context.Background()
	first, err := s.Ingest(ctx, "rs", []history.Item{item("a", 1), item("b", 1)})
	require.NoError(t, err)

	got := make(chan history.Entry, 16)
	done := make(chan error, 1)
	go func() {
		done <- s.Tail(ctx, "rs", first.Cursor, func(e history.Entry) error { got <- e; return nil })
	}()
	_, err = s.Ingest(ctx, "rs", []history.Item{item("a", 2)})
	require.NoError(t, err)
	e := <-got
	require.Equal(t, item("a", 2), e.Item)

	require.NoError(t, s.Delete(ctx, "rs"))
	require.ErrorIs(t, <-done, history.ErrDeleted)
	require.Empty(t, got)
}

func TestDeleteTombstones(t *testing.T) {
	s, rdb := newStore(t)
	ctx := context.Background()
	_, err := s.Ingest(ctx, "rs", []history.Item{item("a", 1)})
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "rs"))
	require.NoError(t, s.Delete(ctx, "rs")) // idempotent
	require.Zero(t, rdb.Exists(ctx, streamKey("rs"), latestKey("rs")).Val())

	_, err = s.Ingest(ctx, "rs", []history.Item{item("a", 2)})
	require.ErrorIs(t, err, history.ErrDeleted)
	_, _, _, err = s.Export(ctx, "rs", Page{})
	require.ErrorIs(t, err, history.ErrDeleted)
	_, err = s.CreateRuntimeSession(ctx, history.RuntimeSession{ID: "rs"})
	require.ErrorIs(t, err, history.ErrDeleted)
	require.Zero(t, rdb.Exists(ctx, streamKey("rs"), latestKey("rs")).Val())

	// A runtime session never seen is tombstoned too: a late first ingest cannot create it.
	require.NoError(t, s.Delete(ctx, "never"))
	_, err = s.Ingest(ctx, "never", []history.Item{item("a", 1)})
	require.ErrorIs(t, err, history.ErrDeleted)
}

// TestTombstonesExpire (issue 32): a tombstone carries a TTL (decision 12),
// the longest grant lifetime plus the longest retry, and is gone after it.
func TestTombstonesExpire(t *testing.T) {
	s, rdb := newStore(t)
	ctx := context.Background()
	require.NoError(t, s.Delete(ctx, "rs"))
	ttl := rdb.PTTL(ctx, metaKey("rs")).Val()
	require.Positive(t, ttl, "the tombstone expires")
	require.LessOrEqual(t, ttl, DefaultTombstoneTTL)
	require.Greater(t, ttl, DefaultTombstoneTTL-time.Minute)

	s.TombstoneTTL = 20 * time.Millisecond
	require.NoError(t, s.Delete(ctx, "short"))
	require.Eventually(t, func() bool { return rdb.Exists(ctx, metaKey("short")).Val() == 0 },
		30*time.Second, 10*time.Millisecond, "the tombstone is gone after its TTL")
}

func TestCreateRuntimeSession(t *testing.T) {
	s, _ := newStore(t)
	ctx := context.Background()
	_, err := s.RuntimeSession(ctx, "rs")
	require.ErrorIs(t, err, history.ErrNotFound)

	// Implicit creation by a first ingest, then the metadata filled in.
	_, err = s.Ingest(ctx, "rs", []history.Item{item("a", 1)})
	require.NoError(t, err)
	rs := history.RuntimeSession{ID: "rs", SessionID: "ses", SandboxID: "sbx", Directory: "/w"}
	got, err := s.CreateRuntimeSession(ctx, rs)
	require.NoError(t, err)
	require.False(t, got.CreateTime.IsZero())
	rs.CreateTime = got.CreateTime
	require.Equal(t, rs, got)

	again, err := s.CreateRuntimeSession(ctx, history.RuntimeSession{ID: "rs", SessionID: "ses"})
	require.NoError(t, err)
	require.Equal(t, rs, again)

	_, err = s.CreateRuntimeSession(ctx, history.RuntimeSession{ID: "rs", Directory: "/other"})
	require.ErrorIs(t, err, history.ErrConflict)
}

var errDone = errors.New("done")

func requireDone(t *testing.T, err error) {
	t.Helper()
	require.ErrorIs(t, err, errDone)
}

func TestTailCursorInsideAnEntry(t *testing.T) {
	s, _ := newStore(t)
	ctx := context.Background()
	first, err := s.Ingest(ctx, "rs", []history.Item{item("a", 1), item("b", 1), item("c", 1)})
	require.NoError(t, err)
	_, err = s.Ingest(ctx, "rs", []history.Item{item("d", 1)})
	require.NoError(t, err)
	var cursors []string
	var got []history.Item
	requireDone(t, s.Tail(ctx, "rs", "", func(e history.Entry) error {
		cursors = append(cursors, e.Cursor)
		got = append(got, e.Item)
		if len(got) == 4 {
			return errDone
		}
		return nil
	}))
	require.Equal(t, []history.Item{item("a", 1), item("b", 1), item("c", 1), item("d", 1)}, got)
	require.Equal(t, first.Cursor, cursors[2])

	// Resuming from the middle of the first entry yields the rest of it, then the next.
	got = nil
	requireDone(t, s.Tail(ctx, "rs", cursors[0], func(e history.Entry) error {
		got = append(got, e.Item)
		if len(got) == 3 {
			return errDone
		}
		return nil
	}))
	require.Equal(t, []history.Item{item("b", 1), item("c", 1), item("d", 1)}, got)

	require.ErrorIs(t, s.Tail(ctx, "rs", "12-3", nil), ErrBadCursor)
}

func TestExportPages(t *testing.T) {
	s, _ := newStore(t)
	ctx := context.Background()
	var all []history.Item
	for _, name := range []string{"e", "a", "d", "b", "c"} {
		all = append(all, item(name, 1))
	}
	_, err := s.Ingest(ctx, "rs", all[:3])
	require.NoError(t, err)
	_, err = s.Ingest(ctx, "rs", all[3:])
	require.NoError(t, err)

	var got []history.Item
	after := ""
	for {
		page, _, more, err := s.Export(ctx, "rs", Page{After: after, Limit: 2})
		require.NoError(t, err)
		require.LessOrEqual(t, len(page), 2)
		got = append(got, page...)
		if !more {
			break
		}
		after = page[len(page)-1].ID
	}
	require.Equal(t, []history.Item{item("a", 1), item("b", 1), item("c", 1), item("d", 1), item("e", 1)}, got)

	// A byte bound ends a page early but always returns at least one item.
	page, _, more, err := s.Export(ctx, "rs", Page{MaxBytes: 1})
	require.NoError(t, err)
	require.True(t, more)
	require.Equal(t, []history.Item{item("a", 1)}, page)
	page, _, more, err = s.Export(ctx, "rs", Page{After: "d", Limit: 1})
	require.NoError(t, err)
	require.False(t, more)
	require.Equal(t, []history.Item{item("e", 1)}, page)
}
