package service

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/replication"
	"agentplane.dev/pkg/storeerr"
	"agentplane.dev/pkg/testclock"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Under a replication policy a watcher sends only events the replicas
// hold: an event the master took but could not replicate (here written
// past the policy while the replica is paused, as a write just before a
// failover is) is not sent, and the watch fails STORE_NOT_REPLICATED so the
// client resumes from its cursor. TestSentinelFailoverAcks once saw an
// ACCEPTED state that a failover then took back.
func TestWatchSendsOnlyReplicatedEvents(t *testing.T) {
	ctx := context.Background()
	master, replica := redistest.StartPair(t)
	rdb := master.Client(t)
	replication.Require(rdb, replication.Policy{Replicas: 1, Timeout: 300 * time.Millisecond})
	svc := suspendReplica(t, rdb, &suspendingSandbox{}, testclock.New(time.Now()))
	_, err := svc.Create(ctx, CreateInput{ID: "s1", UserID: "u1", OrgID: "o1", Directory: "/w", Class: session.CredentialStatic, Secret: "x"})
	require.NoError(t, err)

	cursor, err := store.New(rdb, 1000, nil).LastCursor(ctx, "s1")
	require.NoError(t, err)
	errStop := errors.New("stop")

	require.NoError(t, replica.Pause())
	t.Cleanup(func() { _ = replica.Resume() })
	unconfirmed := store.New(master.Client(t), 1000, nil) // past the policy
	n, err := unconfirmed.AppendRuntime(ctx, "s1", time.Now(), []store.RuntimeEvent{{ID: "e1", Payload: []byte("{}")}})
	require.NoError(t, err)
	require.Equal(t, 1, n)

	var sent []store.StoredEvent
	err = svc.Watch(ctx, "s1", cursor, func(e store.StoredEvent) error {
		sent = append(sent, e)
		return errStop
	})
	require.ErrorIs(t, err, storeerr.ErrNotReplicated)
	require.Empty(t, sent, "an event the replica does not hold is not sent")

	require.NoError(t, replica.Resume())
	err = svc.Watch(ctx, "s1", cursor, func(e store.StoredEvent) error {
		sent = append(sent, e)
		return errStop
	})
	require.ErrorIs(t, err, errStop)
	require.Len(t, sent, 1, "once replicated, the event is sent")
}
