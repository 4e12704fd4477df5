package service

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Issue 33 item 12: with no deletion intent, only a session that is gone
// (not found) counts as already wiped; a store error reading it is an
// error, never a finished deletion.
func TestDeletionWithoutIntentReportsAStoreError(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t).Client(t)
	backstops := session.Backstops{QueuedFor: time.Hour, AcceptedFor: time.Hour}
	s := New(Deps{Store: store.New(rdb, 1000, backstops.NextDeadline), Sandbox: &recordingSandbox{},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		Config{Backstops: backstops, PeerTimeout: 5 * time.Second, Owner: "r1", DeletionLeaseTTL: time.Minute})
	t.Cleanup(s.Close)

	require.NoError(t, s.reconcile(ctx, "gone"), "a session that is not there is wiped")

	// The session's record cannot be read: its key holds another type.
	require.NoError(t, rdb.RPush(ctx, "ses:"+fence.Key(store.Resource("broken"), "meta"), "x").Err())
	err := s.reconcile(ctx, "broken")
	require.Error(t, err, "a store error is not a finished deletion")
	require.Contains(t, err.Error(), "WRONGTYPE")
}

// wipeAfterGoneCheck is another replica's reconciler finishing the wipe of
// session id right after this one's Gone check read it as still there.
type wipeAfterGoneCheck struct {
	rdb  *redis.Client
	id   string
	done bool
}

func (h *wipeAfterGoneCheck) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *wipeAfterGoneCheck) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *wipeAfterGoneCheck) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if args := cmd.Args(); !h.done && cmd.Name() == "exists" && len(args) > 1 && args[1] == "ses:"+fence.Key(store.Resource(h.id), "meta") {
			h.done = true
			keys := h.rdb.Keys(ctx, "*"+h.id+"*").Val()
			if len(keys) > 0 {
				_ = h.rdb.Del(ctx, keys...).Err()
			}
		}
		return err
	}
}

// Issue 32 item 2: a reconciler that read the session as still there just
// before another replica wiped it took the deletion lease and wrote the
// session's fence token again; nothing deleted it (the churn soak left five
// fence:{ses/...}:token keys without a TTL).
func TestDeletionRacingAWipeLeavesNoFenceKey(t *testing.T) {
	ctx := context.Background()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	backstops := session.Backstops{QueuedFor: time.Hour, AcceptedFor: time.Hour}
	s := New(Deps{Store: store.New(rdb, 1000, backstops.NextDeadline), Sandbox: &recordingSandbox{},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		Config{Backstops: backstops, PeerTimeout: 5 * time.Second, Owner: "r1", DeletionLeaseTTL: time.Minute})
	t.Cleanup(s.Close)
	_, err := s.Create(ctx, CreateInput{ID: "s1", UserID: "u1", OrgID: "o1", Directory: "/w", Class: session.CredentialStatic, Secret: "x"})
	require.NoError(t, err)

	rdb.AddHook(&wipeAfterGoneCheck{rdb: srv.Client(t), id: "s1"})
	require.NoError(t, s.reconcile(ctx, "s1"), "a session wiped meanwhile is deleted")
	require.Empty(t, rdb.Keys(ctx, "fence:{ses/s1}:*").Val(), "no fence key of the wiped session is left")
}
