package session

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSuspendDue(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	policy := SuspendPolicy{Default: 2 * time.Minute, Profiles: map[string]time.Duration{"opencode": 5 * time.Minute, "kilo": 0}}
	idle := func(mod func(*Aggregate)) *Aggregate {
		a := &Aggregate{Session: Session{State: StateActive, UpdateTime: t0, Route: RouteView{State: RouteReady}}}
		if mod != nil {
			mod(a)
		}
		return a
	}
	for _, tc := range []struct {
		name string
		a    *Aggregate
		want time.Time // zero: never
	}{
		{"idle ready route: the default after the last change", idle(nil), t0.Add(2 * time.Minute)},
		{"a stopped session's ready runtime too", idle(func(a *Aggregate) { a.Session.State = StateStopped }), t0.Add(2 * time.Minute)},
		{"the session's own suspend_after wins", idle(func(a *Aggregate) {
			a.Session.SuspendAfter = 2 * time.Second
			a.Session.Agent.Profile = "opencode"
		}), t0.Add(2 * time.Second)},
		{"the profile's default", idle(func(a *Aggregate) { a.Session.Agent.Profile = "opencode" }), t0.Add(5 * time.Minute)},
		{"the route's profile when the session named none", idle(func(a *Aggregate) { a.Session.Route.AgentProfile = "opencode" }), t0.Add(5 * time.Minute)},
		{"a profile set to 0 never", idle(func(a *Aggregate) { a.Session.Agent.Profile = "kilo" }), time.Time{}},
		{"queued work", idle(func(a *Aggregate) { a.Active = []*Message{{State: MessageQueued}} }), time.Time{}},
		{"a running turn, however silent", idle(func(a *Aggregate) { a.Active = []*Message{{State: MessageAccepted}} }), time.Time{}},
		{"only ended messages", idle(func(a *Aggregate) {
			a.Active = []*Message{{State: MessageCompleted}, {State: MessageFailed}, {State: MessageCancelled}}
		}), t0.Add(2 * time.Minute)},
		{"already suspended", idle(func(a *Aggregate) { a.Session.Route.State = RouteSuspended }), time.Time{}},
		{"route not ready", idle(func(a *Aggregate) { a.Session.Route.State = RouteUnknown }), time.Time{}},
		{"route preparing", idle(func(a *Aggregate) { a.Session.Route.State = RoutePreparing }), time.Time{}},
		{"route failed", idle(func(a *Aggregate) { a.Session.Route.State = RouteFailed }), time.Time{}},
		{"route reconnecting", idle(func(a *Aggregate) { a.Session.Route.State = RouteReconnecting }), time.Time{}},
		{"being deleted", idle(func(a *Aggregate) { a.Session.State = StateDeleting }), time.Time{}},
		{"a deletion intent", idle(func(a *Aggregate) { a.Intent = &DeletionIntent{} }), time.Time{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, policy.Due(tc.a))
		})
	}
	require.True(t, SuspendPolicy{}.Due(idle(nil)).IsZero(), "a zero default never suspends")
}

// The schedule follows the session: a message clears it, the outcome sets
// it again past the turn's end, a suspend clears it.
func TestSuspendDueFollowsTheTurns(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	p := SuspendPolicy{Default: time.Minute}
	a := &Aggregate{Session: Session{State: StateActive, UpdateTime: t0, Route: RouteView{State: RouteReady}}}
	require.Equal(t, t0.Add(time.Minute), p.Due(a))

	_, _, err := a.Send("m1", "hi", t0.Add(time.Second))
	require.NoError(t, err)
	require.True(t, p.Due(a).IsZero(), "queued")
	a.Accept([]string{"m1"}, t0.Add(2*time.Second))
	require.True(t, p.Due(a).IsZero(), "running")
	end := t0.Add(10 * time.Minute)
	a.Lookup = &Message{ID: "m1", Seq: a.Active[0].Seq} // as a load of the outcome's message has it
	a.Outcome("turn:1", "m1", TurnSucceeded, "", nil, nil, end)
	require.Equal(t, end.Add(time.Minute), p.Due(a), "due suspend_after past the turn's end")

	abort, err := a.BeginSuspend(false, end.Add(time.Minute))
	require.NoError(t, err)
	require.False(t, abort)
	a.Suspended(end.Add(time.Minute))
	require.True(t, p.Due(a).IsZero(), "suspended")
}

func TestCheckSuspendAfter(t *testing.T) {
	for d, ok := range map[time.Duration]bool{
		0: true, time.Second: true, 2 * time.Minute: true, MaxSuspendAfter: true,
		-time.Second: false, time.Millisecond: false, 999 * time.Millisecond: false, MaxSuspendAfter + 1: false,
	} {
		vs := CheckSuspendAfter("suspend_after", d)
		if ok {
			require.Empty(t, vs, "%s", d)
		} else {
			require.Len(t, vs, 1, "%s", d)
			require.Equal(t, "suspend_after", vs[0].Field)
		}
	}
}

func TestParseProfileDurations(t *testing.T) {
	got, err := ParseProfileDurations(" opencode=5m, kilo=0 ,")
	require.NoError(t, err)
	require.Equal(t, map[string]time.Duration{"opencode": 5 * time.Minute, "kilo": 0}, got)
	got, err = ParseProfileDurations("")
	require.NoError(t, err)
	require.Empty(t, got)
	for _, bad := range []string{"opencode", "=5m", "opencode=soon", "opencode=-1m", "opencode=10ms", "a=1m,a=2m"} {
		_, err := ParseProfileDurations(bad)
		require.Error(t, err, bad)
	}
}

// Issue 35 item 5: a resume of a suspended route is timed from its
// message (or ResumeSession, or the route leaving suspended when neither
// came first) to the route ready or failed, once; a suspend in between
// drops it; a route that was never suspended is no resume.
func TestResumeTiming(t *testing.T) {
	n := Notice{FenceToken: 1}
	suspended := func() *Aggregate {
		a := agg()
		a.Ready(n, "rs", "w1", t0)
		a.Suspended(t0)
		require.Equal(t, RouteSuspended, a.Session.Route.State)
		return &Aggregate{Session: a.Session}
	}
	for _, tc := range []struct {
		name  string
		steps func(a *Aggregate)
		want  *ResumeEnd
	}{
		{"a message, then ready", func(a *Aggregate) {
			_, _, err := a.Send("m", "hi", t0.Add(time.Second))
			require.NoError(t, err)
			a.Preparing(n, "", t0.Add(2*time.Second))
			a.Ready(n, "rs", "w2", t0.Add(4*time.Second))
		}, &ResumeEnd{Ready: true, Took: 3 * time.Second}},
		{"ResumeSession, then failed", func(a *Aggregate) {
			require.True(t, a.BeginResume(t0.Add(time.Second)))
			require.False(t, a.BeginResume(t0.Add(2*time.Second)), "the first ask starts the clock")
			a.Failed(n, "wrapper_start_failed", t0.Add(3*time.Second))
		}, &ResumeEnd{Took: 2 * time.Second}},
		{"the route leaves suspended on its own", func(a *Aggregate) {
			a.Preparing(n, "", t0.Add(time.Second))
			a.Ready(n, "rs", "w2", t0.Add(2*time.Second))
		}, &ResumeEnd{Ready: true, Took: time.Second}},
		{"suspended again first", func(a *Aggregate) {
			a.Preparing(n, "", t0.Add(time.Second))
			a.Lost(n, ReasonSuspend, t0.Add(2*time.Second))
			a.Suspended(t0.Add(3 * time.Second))
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := suspended()
			tc.steps(a)
			require.Equal(t, tc.want, a.Resumed())
			require.True(t, a.Session.ResumeSince.IsZero(), "nothing under way after the end")
		})
	}

	a := agg()
	a.Ready(n, "rs", "w1", t0)
	require.False(t, a.BeginResume(t0), "a ready route has nothing to resume")
	_, _, err := a.Send("m", "hi", t0)
	require.NoError(t, err)
	a.Lost(n, "heartbeat_lost", t0)
	a.Ready(n, "rs", "w2", t0.Add(time.Second))
	require.Nil(t, a.Resumed(), "a route never suspended is no resume")
}
