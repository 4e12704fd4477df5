package ownership

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(redistest.Shared(m)) }

func TestSecondReplicaGetsErrHeld(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Universal(t)

	owner, token, err := Current(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Empty(t, owner, "nobody owns a new sandbox")
	require.Zero(t, token)

	a, err := Acquire(ctx, rdb, "sb1", Holder{Replica: "replica-a"}, time.Minute)
	require.NoError(t, err)
	require.Equal(t, "sb1", a.SandboxID)
	require.NotZero(t, a.Token())

	b, err := Acquire(ctx, rdb, "sb1", Holder{Replica: "replica-b"}, time.Minute)
	require.ErrorIs(t, err, ErrHeld)
	require.Nil(t, b)
	require.False(t, IsStale(err), "a held sandbox is not a stale write")

	owner, token, err = Current(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, "replica-a", owner)
	require.Equal(t, a.Token(), token)

	require.NoError(t, a.Release(ctx))
	<-a.Done() // closed by Release
	owner, token, err = Current(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Empty(t, owner, "a released sandbox has no owner")
	require.Zero(t, token)
}

func TestCurrentReturnsReadErrors(t *testing.T) {
	// The driver takes over a sandbox whose Current owner is "": a failed
	// read must not look like a free sandbox.
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	_, err := Acquire(ctx, rdb, "sb1", Holder{Replica: "replica-a"}, time.Minute)
	require.NoError(t, err)

	// A reader that fails at once instead of retrying the dial.
	opts := srv.Options()
	opts.MaxRetries, opts.DialerRetries = -1, 1
	reader := redis.NewClient(opts)
	defer reader.Close()

	require.NoError(t, srv.Stop())
	owner, _, err := Current(ctx, reader, "sb1")
	require.Error(t, err)
	require.Empty(t, owner)
}

func TestTakeoverFencesTheOldOwner(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Universal(t)
	key := "sbx:" + fence.Key(Resource("sb1"), "meta")

	// A short TTL only so that a's renewal notices the loss soon.
	a, err := Acquire(ctx, rdb, "sb1", Holder{Replica: "replica-a"}, time.Second)
	require.NoError(t, err)
	require.NoError(t, a.Guard(ctx, fence.HSet(key, "allocation_id", "from-a")))

	// a's lease is gone (as if it expired while a was paused), and b takes
	// the sandbox over with a newer token.
	require.NoError(t, rdb.Del(ctx, fence.LeaseKey(Resource("sb1"))).Err())
	b, err := Acquire(ctx, rdb, "sb1", Holder{Replica: "replica-b"}, time.Minute)
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Release(context.Background())) }()
	require.Greater(t, b.Token(), a.Token())

	owner, token, err := Current(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, "replica-b", owner)
	require.Equal(t, b.Token(), token)

	err = a.Guard(ctx, fence.HSet(key, "allocation_id", "from-a-again"))
	require.Error(t, err)
	require.True(t, IsStale(err), "stale write: %v", err)
	require.NoError(t, b.Guard(ctx, fence.HSet(key, "allocation_id", "from-b")))
	got, err := rdb.HGet(ctx, key, "allocation_id").Result()
	require.NoError(t, err)
	require.Equal(t, "from-b", got)

	select {
	case <-a.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a's Done did not close after its lease was taken over")
	}
	require.ErrorIs(t, a.Release(ctx), fence.ErrLeaseLost)
	require.True(t, IsStale(a.Release(ctx)), "a lost lease is stale")
}

func TestIsStale(t *testing.T) {
	require.True(t, IsStale(fence.ErrStaleToken))
	require.True(t, IsStale(fence.ErrLeaseLost))
	require.False(t, IsStale(ErrHeld))
	require.False(t, IsStale(errors.New("connection refused")))
	require.False(t, IsStale(nil))
}

// A lease value that is not "<token>:<owner>" is an error, not a free
// sandbox.
func TestCurrentRefusesAMalformedLease(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Universal(t)
	for _, v := range []string{"garbage", "0:owner", "12:", "x:owner", ":owner"} {
		require.NoError(t, rdb.Set(ctx, fence.LeaseKey(Resource("sb-bad")), v, 0).Err())
		owner, token, err := Current(ctx, rdb, "sb-bad")
		require.Error(t, err, "value %q", v)
		require.Empty(t, owner)
		require.Zero(t, token)
	}
}

// The lease names the owner's address: a caller reading it, or told by a
// non-owner, can reach the owner.
func TestLeaseNamesTheOwnersAddress(t *testing.T) {
	ctx := t.Context()
	rdb := redistest.Universal(t)
	a, err := Acquire(ctx, rdb, "sb1", Holder{Replica: "replica-a", Addr: "10.0.0.7:7402"}, time.Minute)
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Release(context.Background()) })
	h, token, err := CurrentHolder(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, Holder{Replica: "replica-a", Addr: "10.0.0.7:7402"}, h)
	require.Equal(t, a.Token(), token)
	owner, _, err := Current(ctx, rdb, "sb1")
	require.NoError(t, err)
	require.Equal(t, "replica-a", owner, "Current names the replica alone")
}
