package store

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/replication"
	"agentplane.dev/services/session/internal/session"
)

// Issue 33 item 13: the load script only reads, yet ran as EVALSHA, which
// the replication hook treats as a write: every load paid a marker write and
// a WAIT, and with the replica unable to confirm, reads failed as
// STORE_NOT_REPLICATED. As EVALSHA_RO it is a read.
func TestLoadIsAReadForReplication(t *testing.T) {
	ctx := context.Background()
	master, replica := redistest.StartPair(t)
	rdb := master.Client(t)
	replication.Require(rdb, replication.Policy{Replicas: 1, Timeout: 300 * time.Millisecond})
	s := New(rdb, 1000, noDeadline)
	sess := &session.Session{ID: "ro", OrgID: "o", UserID: "u", SandboxID: "sbx", Directory: "/w", CreateTime: time.Now()}
	_, _, err := s.Create(ctx, sess, func(*session.Session) error { return nil })
	require.NoError(t, err)

	require.NoError(t, replica.Pause())
	t.Cleanup(func() { _ = replica.Resume() })
	for range 2 { // the first may load the script (EVAL_RO after NOSCRIPT)
		a, _, err := s.load(ctx, s.rdb, "ro", Load{}, nil)
		require.NoError(t, err, "a read needs no replica")
		require.Equal(t, "ro", a.Session.ID)
	}
}
