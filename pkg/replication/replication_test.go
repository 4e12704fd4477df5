package replication_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/replication"
	"agentplane.dev/pkg/storeerr"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var policy = replication.Policy{Replicas: 1, Timeout: 300 * time.Millisecond}

func confirmed(t *testing.T, s *redistest.Server) *redis.Client {
	t.Helper()
	c := s.Client(t)
	replication.Require(c, policy)
	return c
}

// replicated runs a write expected to be confirmed, again while it is not
// confirmed within the policy's 300 ms: on a loaded machine a replica may
// answer later (a test of an unconfirmed write uses a paused replica).
func replicated(t *testing.T, write func() error) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := write()
		if !errors.Is(err, storeerr.ErrNotReplicated) || time.Now().After(deadline) {
			require.NoError(t, err)
			return
		}
	}
}

var incr = redis.NewScript(`return redis.call('INCR', KEYS[1])`)

// writes are the shapes of write the services make: a command, a script, a
// pipeline and a WATCH transaction.
var writes = map[string]func(ctx context.Context, c *redis.Client, key string) error{
	"command": func(ctx context.Context, c *redis.Client, key string) error { return c.Set(ctx, key, "v", 0).Err() },
	"script": func(ctx context.Context, c *redis.Client, key string) error {
		return incr.Run(ctx, c, []string{key}).Err()
	},
	"pipeline": func(ctx context.Context, c *redis.Client, key string) error {
		_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, key, "v", 0)
			p.Get(ctx, key)
			return nil
		})
		return err
	},
	"watch transaction": func(ctx context.Context, c *redis.Client, key string) error {
		return c.Watch(ctx, func(tx *redis.Tx) error {
			if err := tx.Get(ctx, key).Err(); err != nil && !errors.Is(err, redis.Nil) {
				return err
			}
			_, err := tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
				p.Set(ctx, key, "v", 0)
				return nil
			})
			return err
		}, key)
	},
}

// Each write is on the replica when it returns: it waited for the replica.
func TestWriteReturnsOnceOnReplica(t *testing.T) {
	master, replica := redistest.StartPair(t)
	c, rc := confirmed(t, master), replica.Client(t)
	for name, write := range writes {
		t.Run(name, func(t *testing.T) {
			key := "{" + name + "}k"
			for range 20 {
				replicated(t, func() error { return write(t.Context(), c, key) })
				mv, err := master.Client(t).Get(t.Context(), key).Result()
				require.NoError(t, err)
				require.Equal(t, mv, rc.Get(t.Context(), key).Val(), "the replica has what the master acknowledged")
			}
		})
	}
	require.Zero(t, master.Client(t).Exists(t.Context(), "{command}agentplane:replicated").Val(), "the marker is deleted")
}

// A write the replica cannot acknowledge fails as ErrNotReplicated (and is on
// the master: it is not acknowledged, not undone); reads still serve.
func TestUnconfirmedWriteFails(t *testing.T) {
	master, replica := redistest.StartPair(t)
	c := confirmed(t, master)
	require.NoError(t, replica.Pause())
	t.Cleanup(func() { _ = replica.Resume() })
	for name, write := range writes {
		t.Run(name, func(t *testing.T) {
			key := "{" + name + "}k"
			err := write(t.Context(), c, key)
			require.ErrorIs(t, err, storeerr.ErrNotReplicated)
			require.True(t, storeerr.Unavailable(err))
			require.Equal(t, int64(1), c.Exists(t.Context(), key).Val(), "the write is on the master")
		})
	}
	require.NoError(t, c.Get(t.Context(), "{command}k").Err(), "reads need no replica")

	// Once the replica is back, the same write (a retry) is confirmed, and so
	// is the earlier one it repeats, though the retry changed nothing new.
	require.NoError(t, replica.Resume())
	replicated(t, func() error { return writes["command"](t.Context(), c, "{command}k") })
}

// With Replicas 0 nothing is installed: writes succeed without replicas.
func TestZeroReplicasWaitsForNothing(t *testing.T) {
	s := redistest.Start(t)
	c := s.Client(t)
	replication.Require(c, replication.Policy{})
	require.NoError(t, c.Set(t.Context(), "k", "v", 0).Err())
}

// Every command of Redis' @write category is confirmed.
func TestEveryRedisWriteCommandIsConfirmed(t *testing.T) {
	s := redistest.Start(t)
	names, err := s.Client(t).Do(t.Context(), "COMMAND", "LIST", "FILTERBY", "ACLCAT", "write").StringSlice()
	require.NoError(t, err)
	require.NotEmpty(t, names)
	for _, n := range names {
		top, _, _ := strings.Cut(n, "|")
		require.Truef(t, replication.IsWrite(top), "%s is a write command", top)
	}
	require.False(t, replication.IsWrite("get"))
}

// On a Cluster a write waits on its own master: with one master's replica
// paused, a key on that master fails and a key on another master succeeds.
func TestClusterWaitsOnTheKeysMaster(t *testing.T) {
	cl := redistest.StartCluster(t)
	ctx := t.Context()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = cc.Close() })
	replication.Require(cc, policy)

	const paused = "{a}k"
	m, err := cl.MasterOf(ctx, paused)
	require.NoError(t, err)
	other := ""
	for _, k := range []string{"{b}k", "{c}k", "{d}k", "{e}k", "{f}k", "{g}k"} {
		if om, err := cl.MasterOf(ctx, k); err == nil && om != m {
			other = k
			break
		}
	}
	require.NotEmpty(t, other, "a key on another master")
	replicated(t, func() error { return cc.Set(ctx, paused, "1", 0).Err() })

	r, err := cl.ReplicaOf(ctx, m)
	require.NoError(t, err)
	require.NoError(t, r.Pause())
	t.Cleanup(func() { _ = r.Resume() })

	require.ErrorIs(t, cc.Set(ctx, paused, "2", 0).Err(), storeerr.ErrNotReplicated)
	replicated(t, func() error { return cc.Set(ctx, other, "2", 0).Err() }) // another master's replica is up
	_, err = cc.TxPipelined(ctx, func(p redis.Pipeliner) error { p.Incr(ctx, paused); return nil })
	require.ErrorIs(t, err, storeerr.ErrNotReplicated)
	require.ErrorIs(t, cc.Watch(ctx, func(tx *redis.Tx) error {
		_, err := tx.TxPipelined(ctx, func(p redis.Pipeliner) error { p.Incr(ctx, paused); return nil })
		return err
	}, paused), storeerr.ErrNotReplicated)
	require.NoError(t, r.Resume())
	replicated(t, func() error { return cc.Set(ctx, paused, "3", 0).Err() })
}
