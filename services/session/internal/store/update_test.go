package store

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/session/internal/session"
)

func newUpdateStore(t *testing.T) *Store {
	t.Helper()
	rdb := redistest.Start(t).Client(t)
	return New(rdb, 1000, func(*session.Aggregate) time.Time { return time.Time{} })
}

func createSession(t *testing.T, s *Store, id string) {
	t.Helper()
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	sess := &session.Session{ID: id, OrgID: "o", UserID: "u", SandboxID: "sbx", Directory: "/w",
		State: session.StateActive, CreateTime: now, UpdateTime: now}
	_, _, err := s.Create(context.Background(), sess, func(*session.Session) error { return nil })
	require.NoError(t, err)
}

// Concurrent writers of one session never lose a change: every transition
// that conflicts re-runs on fresh state (WATCH now travels with the load).
func TestUpdateConcurrentWritersLoseNothing(t *testing.T) {
	s := newUpdateStore(t)
	ctx := context.Background()
	createSession(t, s, "c1")
	const writers, each = 8, 25
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				mid := fmt.Sprintf("m-%d-%d", w, i)
				_, err := s.Update(ctx, "c1", Load{MessageID: mid}, func(a *session.Aggregate) error {
					_, _, err := a.Send(mid, "text", time.Now())
					return err
				})
				require.NoError(t, err)
			}
		})
	}
	wg.Wait()
	a, err := s.Read(ctx, "c1", Load{Content: true})
	require.NoError(t, err)
	require.Len(t, a.Active, writers*each)
	seqs := map[uint64]bool{}
	for _, m := range a.Active {
		require.Equal(t, "text", m.Content)
		require.False(t, seqs[m.Seq], "sequence %d handed out twice", m.Seq)
		seqs[m.Seq] = true
	}
}

// The load script is sent again after the server lost its script cache
// (restart, SCRIPT FLUSH).
func TestLoadSurvivesScriptFlush(t *testing.T) {
	s := newUpdateStore(t)
	ctx := context.Background()
	createSession(t, s, "f1")
	_, err := s.Read(ctx, "f1", Load{})
	require.NoError(t, err)
	require.NoError(t, s.rdb.ScriptFlush(ctx).Err())
	_, err = s.Update(ctx, "f1", Load{MessageID: "m1", SeenIDs: []string{"turn:t1"}}, func(a *session.Aggregate) error {
		_, _, err := a.Send("m1", "hello", time.Now())
		return err
	})
	require.NoError(t, err)
	require.NoError(t, s.rdb.ScriptFlush(ctx).Err())
	a, err := s.Read(ctx, "f1", Load{MessageID: "m1", Content: true, SeenIDs: []string{"turn:t1"}})
	require.NoError(t, err)
	require.NotNil(t, a.Lookup)
	require.Len(t, a.Active, 1)
	require.Equal(t, "hello", a.Active[0].Content)
	require.False(t, a.Seen["turn:t1"])
}
