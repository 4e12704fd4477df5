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
	rdb := redistest.Universal(t)
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

// A store's kept state is only a guess: another replica's write makes its
// commit write nothing and the change run again on fresh state. With a
// frozen clock the record stays byte-identical across a cancel, so only the
// comparison of the message states catches it.
func TestKeptStateNeverOverwritesAnotherWriter(t *testing.T) {
	rdb := redistest.Universal(t)
	noDeadline := func(*session.Aggregate) time.Time { return time.Time{} }
	s1, s2 := New(rdb, 1000, noDeadline), New(rdb, 1000, noDeadline)
	ctx := context.Background()
	createSession(t, s1, "k1")
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	send := func(s *Store, mid string) {
		t.Helper()
		_, err := s.Update(ctx, "k1", Load{MessageID: mid}, func(a *session.Aggregate) error {
			_, _, err := a.Send(mid, "text", now)
			return err
		})
		require.NoError(t, err)
	}
	// Alternating replicas: each commit starts from the other's stale state.
	for i := range 10 {
		send([]*Store{s1, s2}[i%2], fmt.Sprint("m", i))
	}
	a, err := s1.Read(ctx, "k1", Load{})
	require.NoError(t, err)
	require.Len(t, a.Active, 10)
	for i, m := range a.Active {
		require.Equal(t, uint64(i+1), m.Seq)
	}

	// A change of the record alone (s2 records a ready route) is seen by
	// s1's next change.
	send(s1, "m10") // s1 now keeps the current state
	_, err = s2.Update(ctx, "k1", Load{}, func(a *session.Aggregate) error {
		a.Ready(session.Notice{}, "rt-2", "w2", now)
		return nil
	})
	require.NoError(t, err)
	send(s1, "m11")
	sess, err := s1.Get(ctx, "k1")
	require.NoError(t, err)
	require.Equal(t, "rt-2", sess.Route.RuntimeSessionID)

	// s1 keeps m0 queued; s2 accepts it at the same instant, which leaves
	// the record byte-identical; s1's cancel must see accepted work.
	_, err = s2.Update(ctx, "k1", Load{}, func(a *session.Aggregate) error {
		a.Accept([]string{"m0"}, now)
		return nil
	})
	require.NoError(t, err)
	var abort bool
	_, err = s1.Update(ctx, "k1", Load{MessageID: "m0"}, func(a *session.Aggregate) error {
		_, abort = a.Cancel(now)
		return nil
	})
	require.NoError(t, err)
	require.True(t, abort, "cancel decided on a stale queued state")

	// A deletion begun by s2 stops s1's next send.
	_, err = s2.Update(ctx, "k1", Load{}, func(a *session.Aggregate) error {
		a.BeginDeletion("client", now)
		return nil
	})
	require.NoError(t, err)
	_, err = s1.Update(ctx, "k1", Load{MessageID: "late"}, func(a *session.Aggregate) error {
		if a.Intent != nil {
			return session.ErrSessionNotFound
		}
		_, _, err := a.Send("late", "text", now)
		return err
	})
	require.ErrorIs(t, err, session.ErrSessionNotFound)
}

// A change committed from the kept state stores what the same change
// committed after a load stores.
func TestKeptStateCommitsWhatALoadWould(t *testing.T) {
	ctx := context.Background()
	run := func(keep bool) map[string]string {
		rdb := redistest.Universal(t)
		s := New(rdb, 1000, func(a *session.Aggregate) time.Time { // as the service's backstops
			return session.Backstops{QueuedFor: time.Hour, AcceptedFor: time.Hour}.NextDeadline(a)
		})
		createSession(t, s, "e1")
		now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
		for i := range 4 {
			if !keep {
				s.recent.forget("e1")
			}
			mid := fmt.Sprint("m", i)
			_, err := s.Update(ctx, "e1", Load{MessageID: mid}, func(a *session.Aggregate) error {
				_, _, err := a.Send(mid, "text", now.Add(time.Duration(i)*time.Second))
				return err
			})
			require.NoError(t, err)
			if !keep {
				s.recent.forget("e1")
			}
			_, err = s.Update(ctx, "e1", Load{}, func(a *session.Aggregate) error {
				a.Accept([]string{mid}, now.Add(time.Duration(i)*time.Second+time.Millisecond))
				return nil
			})
			require.NoError(t, err)
		}
		if !keep {
			s.recent.forget("e1")
		}
		_, err := s.Update(ctx, "e1", Load{MessageID: "m2", SeenIDs: []string{"turn:t"}}, func(a *session.Aggregate) error {
			a.Outcome("turn:t", "m2", session.TurnSucceeded, "", nil, nil, now.Add(time.Minute))
			return nil
		})
		require.NoError(t, err)
		out := map[string]string{}
		meta, err := s.rdb.Get(ctx, key("e1", "meta")).Result()
		require.NoError(t, err)
		out["meta"] = meta
		for _, k := range []string{"msgs", "content"} {
			out[k] = fmt.Sprint(s.rdb.HGetAll(ctx, key("e1", k)).Val())
		}
		for _, k := range []string{key("e1", "order"), key("e1", "active"), idxActive, idxUpdated} {
			out[k] = fmt.Sprint(s.rdb.ZRangeWithScores(ctx, k, 0, -1).Val())
		}
		out["seen"] = fmt.Sprint(s.rdb.SMembers(ctx, key("e1", "seen")).Val())
		for i, e := range s.rdb.XRange(ctx, key("e1", "events"), "-", "+").Val() {
			out[fmt.Sprint("event", i)] = fmt.Sprint(e.Values)
		}
		return out
	}
	require.Equal(t, run(false), run(true))
}

// Sessions by state (issue 22): the counts move in the same write as each
// state change, whichever path commits it, and a wipe ends the deleting one.
func TestStateCountsFollowEveryTransition(t *testing.T) {
	s := newUpdateStore(t)
	ctx := context.Background()
	counts := func() map[session.State]int64 {
		c, err := s.StateCounts(ctx)
		require.NoError(t, err)
		return c
	}
	for _, id := range []string{"k1", "k2", "k3"} {
		createSession(t, s, id)
	}
	createSession(t, s, "k1") // the same request again creates nothing
	require.Equal(t, map[session.State]int64{session.StateActive: 3, session.StateStopped: 0, session.StateDeleting: 0}, counts())

	now := time.Now()
	for range 2 { // the second stop changes nothing
		_, err := s.Update(ctx, "k2", Load{}, func(a *session.Aggregate) error { a.Stop(now); return nil })
		require.NoError(t, err)
	}
	require.Equal(t, map[session.State]int64{session.StateActive: 2, session.StateStopped: 1, session.StateDeleting: 0}, counts())
	_, err := s.Update(ctx, "k2", Load{MessageID: "m1"}, func(a *session.Aggregate) error {
		_, _, err := a.Send("m1", "again", now)
		return err
	})
	require.NoError(t, err)
	require.Equal(t, map[session.State]int64{session.StateActive: 3, session.StateStopped: 0, session.StateDeleting: 0}, counts(), "a new message makes it active")

	var in *session.DeletionIntent
	_, err = s.Update(ctx, "k3", Load{}, func(a *session.Aggregate) error { in = a.BeginDeletion("user", now); return nil })
	require.NoError(t, err)
	require.Equal(t, map[session.State]int64{session.StateActive: 2, session.StateStopped: 0, session.StateDeleting: 1}, counts())
	l, err := s.DeletionLease(ctx, "k3", "t", time.Minute)
	require.NoError(t, err)
	require.NoError(t, s.Wipe(ctx, l, in, WipeLocator{SandboxID: "sbx", Directory: "/w"}, 0))
	require.Equal(t, map[session.State]int64{session.StateActive: 2, session.StateStopped: 0, session.StateDeleting: 0}, counts())
}

// On Cluster the backstop schedule is written right after the transaction:
// an attempt that failed in between (a master killed) left the queued
// message in no sweep's schedule. Its caller's retry, a replay that writes
// nothing, puts the session back on the schedule.
func TestUpdateReplayRestoresTheSchedule(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.StartCluster(t).Client(t)
	due := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	s := New(rdb, 1000, func(a *session.Aggregate) time.Time {
		if len(a.Queued()) > 0 {
			return due
		}
		return time.Time{}
	})
	createSession(t, s, "r1")
	send := func(a *session.Aggregate) error {
		_, _, err := a.Send("m1", "text", time.Now())
		return err
	}
	_, err := s.Update(ctx, "r1", Load{MessageID: "m1"}, send)
	require.NoError(t, err)
	require.NoError(t, rdb.ZRem(ctx, idxActive, "r1").Err()) // the schedule write that did not happen

	_, err = s.Update(ctx, "r1", Load{MessageID: "m1"}, send)
	require.NoError(t, err)
	ids, err := s.DueActive(ctx, due, 10)
	require.NoError(t, err)
	require.Equal(t, []string{"r1"}, ids)
}
