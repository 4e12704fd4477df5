package leasestore

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/sandbox/internal/control/lease"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(redistest.Shared(m)) }

func TestFencedCompareAndSet(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Universal(t)
	now := time.Now()
	s := New(rdb, func() time.Time { return now })
	require.Equal(t, "sbx:{sb1}:wrapper-leases", Key("sb1"))
	require.Equal(t, "sb1", fence.HashTag(Key("sb1")))

	old, err := fence.Acquire(ctx, rdb, "sb1", "a", time.Minute)
	require.NoError(t, err)
	e, err := s.Get(ctx, "sb1", "k")
	require.NoError(t, err)
	require.Equal(t, lease.None, e.Lease.State)

	owned := lease.Apply(lease.DefaultPolicy(), e.Lease, lease.Allocate{Instance: "i", Now: now})
	e2, err := s.Put(ctx, "sb1", old.Token, "k", e, owned)
	require.NoError(t, err)
	_, err = s.Put(ctx, "sb1", old.Token, "k", e, owned) // read before e2 was written
	require.ErrorIs(t, err, ErrConflict)

	require.NoError(t, old.Release(ctx))
	cur, err := fence.Acquire(ctx, rdb, "sb1", "b", time.Minute)
	require.NoError(t, err)
	stop := lease.Apply(lease.DefaultPolicy(), owned, lease.RequestStop{Reason: "x", Now: now})
	_, err = s.Put(ctx, "sb1", old.Token, "k", e2, stop)
	require.ErrorIs(t, err, fence.ErrStaleToken, "a stale owner writes nothing")
	got, err := s.Get(ctx, "sb1", "k")
	require.NoError(t, err)
	require.Equal(t, lease.OwnsWrapper, got.Lease.State)
	_, err = s.Put(ctx, "sb1", cur.Token, "k", got, stop)
	require.NoError(t, err)

	all, err := s.All(ctx, "sb1")
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.Equal(t, lease.StopNeeded, all["k"].Lease.State)

	// Garbage is quarantined, and the next write replaces it.
	require.NoError(t, rdb.HSet(ctx, Key("sb1"), "bad", "}{").Err())
	bad, err := s.Get(ctx, "sb1", "bad")
	require.NoError(t, err)
	require.Error(t, bad.Quarantined)
	require.True(t, bad.Lease.Exhausted)
	_, err = s.Put(ctx, "sb1", cur.Token, "bad", bad, bad.Lease)
	require.NoError(t, err)
	fixed, err := s.Get(ctx, "sb1", "bad")
	require.NoError(t, err)
	require.NoError(t, fixed.Quarantined)
}
