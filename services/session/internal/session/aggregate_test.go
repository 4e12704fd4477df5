package session

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

func agg() *Aggregate {
	return &Aggregate{Session: Session{ID: "s", SandboxID: "sbx", State: StateActive, Route: RouteView{State: RouteUnknown}}}
}

func TestTerminalStatesAreFinal(t *testing.T) {
	for _, st := range []MessageState{MessageCompleted, MessageFailed, MessageCancelled} {
		a := agg()
		m := &Message{ID: "m", State: st, Seq: 1}
		a.Active = []*Message{m}
		a.Failed(Notice{}, "x", t0)
		a.Stop(t0)
		Backstops{QueuedFor: time.Second, AcceptedFor: time.Second}.Apply(a, t0.Add(time.Hour))
		require.Equal(t, st, m.State)
		require.Empty(t, a.Changed())
	}
}

func TestOutcomeSettlesUpToLastMessage(t *testing.T) {
	a := agg()
	m1 := &Message{ID: "m1", State: MessageAccepted, Seq: 1}
	m2 := &Message{ID: "m2", State: MessageAccepted, Seq: 2}
	m3 := &Message{ID: "m3", State: MessageAccepted, Seq: 3}
	a.Active = []*Message{m1, m2, m3}
	a.Lookup = m2
	a.Seen = map[string]bool{}
	a.Outcome("t1", "m2", TurnFailed, "", nil, nil, t0)
	require.Equal(t, MessageFailed, m1.State)
	require.Equal(t, ReasonTurnFailed, m2.FailureReason)
	require.Equal(t, MessageAccepted, m3.State)

	a.Seen["t2"] = true // a repeated turn id settles nothing
	a.Lookup = m3
	a.Outcome("t2", "m3", TurnSucceeded, "", nil, nil, t0)
	require.Equal(t, MessageAccepted, m3.State)
}

// The replica that delivered m1 and m2 died before it recorded them
// accepted: the outcome naming m2 still settles both, not m3.
func TestOutcomeSettlesDeliveredMessagesStillQueued(t *testing.T) {
	a := agg()
	m1 := &Message{ID: "m1", State: MessageQueued, Seq: 1}
	m2 := &Message{ID: "m2", State: MessageQueued, Seq: 2}
	m3 := &Message{ID: "m3", State: MessageQueued, Seq: 3}
	a.Active = []*Message{m1, m2, m3}
	a.Lookup = m2
	a.Seen = map[string]bool{}
	a.Outcome("t1", "m2", TurnSucceeded, "", nil, nil, t0)
	require.Equal(t, MessageCompleted, m1.State)
	require.Equal(t, MessageCompleted, m2.State)
	require.Equal(t, MessageQueued, m3.State)
}

// m1 was delivered, then lost with the master that held it (a failover
// before replication); the outcome of its turn names a message the store
// no longer has. The caller's retry stores m1 again, and its redelivery
// brings the same turn id: that outcome must settle m1.
func TestOutcomeOfAnUnknownMessageLeavesItsTurnOpen(t *testing.T) {
	a := agg()
	a.Seen = map[string]bool{}
	a.Outcome("turn-m1", "m1", TurnSucceeded, "", []byte("p"), nil, t0)
	require.Empty(t, a.SeenAdded(), "the turn id is not recorded")
	require.Empty(t, a.Events(), "nothing is recorded")

	m1 := &Message{ID: "m1", State: MessageAccepted, Seq: 1}
	a.Active = []*Message{m1}
	a.Lookup = m1
	a.Outcome("turn-m1", "m1", TurnSucceeded, "", []byte("p"), nil, t0)
	require.Equal(t, MessageCompleted, m1.State)
	require.Equal(t, []string{"turn-m1"}, a.SeenAdded())
}

func TestNoticesFromOtherSandboxesOrOlderTokensAreDropped(t *testing.T) {
	a := agg()
	a.Session.Route.FenceToken = 7
	require.False(t, a.Accepts(Notice{SandboxID: "other"}))
	require.False(t, a.Accepts(Notice{FenceToken: 6}))
	require.True(t, a.Accepts(Notice{FenceToken: 7}))
	require.True(t, a.Accepts(Notice{SandboxID: "sbx", FenceToken: 8}))
	require.False(t, a.Accepts(Notice{SandboxID: "sbx"}), "zero is no fencing token")
	a.Session.State = StateDeleting
	require.False(t, a.Accepts(Notice{FenceToken: 9}))
}

func TestFenceTokensNoOwnerIssuedAreRefused(t *testing.T) {
	now := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	require.NotEmpty(t, CheckFenceToken("f", 0, now), "zero")
	require.NotEmpty(t, CheckFenceToken("f", math.MaxUint64, now), "2^64-1")
	require.NotEmpty(t, CheckFenceToken("f", uint64(now.Add(MaxFenceLead+time.Second).UnixMicro()), now))
	require.Empty(t, CheckFenceToken("f", uint64(now.UnixMicro()), now), "a token from Redis TIME now")
	require.Empty(t, CheckFenceToken("f", uint64(now.Add(time.Hour).UnixMicro()), now), "clock skew")
	require.Empty(t, CheckFenceToken("f", 5, now), "an old owner's token")
}

func TestBackoffGrowsAndHonoursPeer(t *testing.T) {
	b := Backoff{Base: time.Second, Max: 10 * time.Second}
	require.Equal(t, time.Second, b.Delay(1, 0))
	require.Equal(t, 4*time.Second, b.Delay(3, 0))
	require.Equal(t, 10*time.Second, b.Delay(9, 0))
	require.Equal(t, 30*time.Second, b.Delay(1, 30*time.Second))
	var in DeletionIntent
	d := in.Postpone(b, "verify_absence", 0, t0)
	require.Equal(t, 1, in.Attempts)
	require.Equal(t, t0.Add(d), in.NextAttempt)
}

func TestSandboxForIsDeterministicPerUser(t *testing.T) {
	require.Equal(t, "sbx-"+Digest("o\x00u")[:16], SandboxFor("o", "u"))
	require.NotEqual(t, SandboxFor("o", "u"), SandboxFor("o", "u2"))
	require.NotEqual(t, SandboxFor("ou", ""), SandboxFor("o", "u"))
	require.Empty(t, CheckID("sandbox_id", SandboxFor("o", "u")))
}

// Issue 18 item 7: every runtime session id the route had is kept, once,
// and the deletion intent carries all of them.
func TestEveryRuntimeSessionIDIsRecordedForDeletion(t *testing.T) {
	a := agg()
	n := Notice{FenceToken: 1}
	a.Ready(n, "rs_1", "w1", t0)
	a.Lost(n, "heartbeat_lost", t0)
	a.SawRuntimeSession("rs_2", t0)
	a.Ready(n, "rs_2", "w2", t0)
	a.Ready(n, "rs_2", "w2", t0)
	require.Equal(t, []string{"rs_1", "rs_2"}, a.Session.RuntimeSessionIDs)
	in := a.BeginDeletion("client", t0)
	require.Equal(t, []string{"rs_1", "rs_2"}, in.HistoryIDs())
	old := DeletionIntent{RuntimeSessionID: "rs_9"} // persisted before runtime_session_ids existed
	require.Equal(t, []string{"rs_9"}, old.HistoryIDs())
}

// Issue 35: suspend refuses queued or accepted work unless forced (which
// cancels it and asks for an abort of the running turn); a route lost or
// failed for the suspend stop shows suspended, any other loss unknown; a
// message sent meanwhile keeps Suspended from hiding it.
func TestSuspend(t *testing.T) {
	n := Notice{FenceToken: 1}
	for _, tc := range []struct {
		name      string
		msgs      []MessageState
		force     bool
		err       error
		abort     bool
		cancelled bool
	}{
		{name: "idle", msgs: nil},
		{name: "terminal work only", msgs: []MessageState{MessageCompleted}},
		{name: "queued", msgs: []MessageState{MessageQueued}, err: ErrTurnRunning},
		{name: "accepted", msgs: []MessageState{MessageAccepted}, err: ErrTurnRunning},
		{name: "queued forced", msgs: []MessageState{MessageQueued}, force: true, cancelled: true},
		{name: "accepted forced", msgs: []MessageState{MessageAccepted, MessageQueued}, force: true, abort: true, cancelled: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := agg()
			for i, st := range tc.msgs {
				a.Active = append(a.Active, &Message{ID: string(rune('a' + i)), State: st, Seq: uint64(i + 1)})
			}
			abort, err := a.BeginSuspend(tc.force, t0)
			require.ErrorIs(t, err, tc.err)
			require.Equal(t, tc.abort, abort)
			for _, m := range a.Active {
				if tc.cancelled {
					require.Equal(t, MessageCancelled, m.State)
				} else if tc.err != nil {
					require.False(t, m.State.Terminal(), "a refused suspend changes nothing")
				}
			}
		})
	}

	a := agg()
	a.Ready(n, "rs_1", "w1", t0)
	require.False(t, a.Lost(n, ReasonSuspend, t0))
	require.Equal(t, RouteUnknown, a.Session.Route.State, "stopping for a suspend is not suspended")
	a.Ready(n, "rs_1", "w2", t0)
	a.Failed(n, ReasonSuspend, t0)
	require.Equal(t, RouteUnknown, a.Session.Route.State, "a preparation the suspend stopped is lost, not failed")
	a.Lost(n, "heartbeat_lost", t0)
	require.Equal(t, RouteUnknown, a.Session.Route.State)
	a.Suspended(t0)
	require.Equal(t, RouteSuspended, a.Session.Route.State, "only the verified absence suspends")
	a.Lost(n, ReasonSuspend, t0)
	require.Equal(t, RouteSuspended, a.Session.Route.State, "the late notice of a verified stop changes nothing")

	a = agg()
	_, _, err := a.Send("m", "hi", t0)
	require.NoError(t, err)
	a.Suspended(t0)
	require.Equal(t, RouteUnknown, a.Session.Route.State, "a message sent during the suspend resumes it")

	a = agg()
	a.Session.State = StateDeleting
	_, err = a.BeginSuspend(true, t0)
	require.ErrorIs(t, err, ErrSessionNotFound)
}
