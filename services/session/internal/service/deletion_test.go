package service

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

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
