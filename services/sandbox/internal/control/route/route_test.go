package route

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/control/scope"
)

// One route per state, all on runtime key k1 served by instance i1.
func states() map[string]Route {
	on := func(s State) Route {
		return Route{State: s, Directory: "/d", RuntimeKey: "k1", Contract: scope.PerSession, WrapperInstance: "i1", RuntimeSessionID: "rs1"}
	}
	prep := on(Preparing)
	prep.Step = StepWaitForWrapper
	failed := on(Failed)
	failed.FailureReason, failed.Retryable = "capacity_rejected", true
	released := on(Released)
	released.MemberReleasePending = true
	return map[string]Route{
		"absent": {}, "unknown": on(Unknown), "preparing": prep, "ready": on(Ready),
		"reconnecting": on(Reconnecting), "failed": failed, "released": released,
	}
}

// Events that apply when they can: runtime key k1, instance i1 kept.
func events() map[string]Event {
	return map[string]Event{
		"prepare":          Prepare{Directory: "/d"},
		"keyed":            Keyed{RuntimeKey: "k2", Contract: scope.Worktree},
		"step":             StepReached{Step: StepCreateSandbox},
		"prepare_sent":     PrepareSent{Contract: scope.Worktree, RuntimeSessionID: "rs2"},
		"hello":            WrapperHello{RuntimeKey: "k1", Instance: "i1", Kept: true, RuntimeSessionID: "rs2"},
		"route_ready":      RouteReady{RuntimeKey: "k1", Instance: "i2", RuntimeSessionID: "rs2"},
		"route_failed":     RouteFailed{Reason: "boom", Retryable: true},
		"stream_closed":    StreamClosed{RuntimeKey: "k1"},
		"owner_resumed":    OwnerResumed{},
		"key_stopped":      KeyStopped{},
		"wrapper_stopping": WrapperStopping{RuntimeKey: "k1", Reason: "idle"},
		"wrapper_gone":     WrapperGone{RuntimeKey: "k1", Reason: "wrapper_exited"},
		"release":          Release{Credentials: true},
		"member_released":  MemberReleased{},
		"forget":           Forget{},
		"recreated":        Recreated{},
	}
}

// Expected "<next state> <effects...>" after each (state, event); "=" means
// the route is unchanged. Effects are spelt by flags below.
var table = map[string]map[string]string{
	"absent": {
		"prepare": "preparing admit persist start_preparing", "keyed": "=", "step": "=", "prepare_sent": "=", "hello": "=",
		"route_ready": "=", "route_failed": "=", "stream_closed": "=", "owner_resumed": "=", "key_stopped": "=",
		"wrapper_stopping": "=", "wrapper_gone": "=", "release": "=", "member_released": "=", "forget": "=", "recreated": "=",
	},
	"unknown": {
		"prepare": "preparing admit persist start_preparing", "keyed": "=", "step": "=", "prepare_sent": "unknown persist", "hello": "=",
		"route_ready": "ready persist join notify:ready", "route_failed": "failed persist notify:failed",
		"stream_closed": "=", "owner_resumed": "=", "key_stopped": "=", "wrapper_stopping": "=", "wrapper_gone": "=",
		"release": "released persist leave drop send_release", "member_released": "=", "forget": "=", "recreated": "=",
	},
	"preparing": {
		"prepare": "= start_preparing", "keyed": "preparing persist", "step": "preparing persist", "prepare_sent": "preparing persist",
		"hello": "preparing persist send_prepare", "route_ready": "ready persist join notify:ready",
		"route_failed": "failed persist notify:failed", "stream_closed": "=", "owner_resumed": "= start_preparing", "key_stopped": "= start_preparing",
		"wrapper_stopping": "failed persist notify:failed", "wrapper_gone": "=",
		"release": "released persist leave drop send_release", "member_released": "=", "forget": "=", "recreated": "=",
	},
	"ready": {
		"prepare": "=", "keyed": "=", "step": "=", "prepare_sent": "ready persist", "hello": "ready persist notify:ready",
		"route_ready": "ready persist join notify:ready", "route_failed": "failed persist notify:failed",
		"stream_closed": "reconnecting persist notify:reconnecting", "owner_resumed": "reconnecting persist notify:reconnecting",
		"key_stopped": "=", "wrapper_stopping": "unknown persist notify:lost", "wrapper_gone": "unknown persist notify:lost",
		"release": "released persist leave drop send_release", "member_released": "=", "forget": "=", "recreated": "=",
	},
	"reconnecting": {
		"prepare": "=", "keyed": "=", "step": "=", "prepare_sent": "reconnecting persist", "hello": "ready persist notify:ready",
		"route_ready": "ready persist join notify:ready", "route_failed": "failed persist notify:failed",
		"stream_closed": "=", "owner_resumed": "=", "key_stopped": "=",
		"wrapper_stopping": "unknown persist notify:lost", "wrapper_gone": "unknown persist notify:lost",
		"release": "released persist leave drop send_release", "member_released": "=", "forget": "=", "recreated": "=",
	},
	"failed": {
		"prepare": "preparing admit persist start_preparing", "keyed": "=", "step": "=", "prepare_sent": "failed persist", "hello": "=",
		"route_ready": "ready persist join notify:ready", "route_failed": "failed persist notify:failed",
		"stream_closed": "=", "owner_resumed": "=", "key_stopped": "=", "wrapper_stopping": "=", "wrapper_gone": "=",
		"release": "released persist leave drop send_release", "member_released": "=", "forget": "=", "recreated": "=",
	},
	"released": {
		"prepare": "preparing admit persist start_preparing", "keyed": "=", "step": "=", "prepare_sent": "released persist", "hello": "=",
		"route_ready": "=", "route_failed": "=", "stream_closed": "=", "owner_resumed": "=", "key_stopped": "=",
		"wrapper_stopping": "=", "wrapper_gone": "=", "release": "=", "member_released": "released persist", "forget": "absent delete", "recreated": "=",
	},
}

// flags spells the effects that are set, in the order the caller performs them.
func flags(e Effects) []string {
	f := []string{}
	add := func(on bool, name string) {
		if on {
			f = append(f, name)
		}
	}
	add(e.Err != nil, "err")
	add(e.Admit, "admit")
	add(e.Persist, "persist")
	add(e.Delete, "delete")
	add(e.JoinScope, "join")
	add(e.LeaveScope, "leave")
	add(e.DropHandle, "drop")
	add(e.Restarted, "restarted")
	add(e.SendPrepare, "send_prepare")
	add(e.SendRelease, "send_release")
	add(e.Notify != NoticeNone, "notify:"+map[Notice]string{NoticeReady: "ready", NoticeReconnecting: "reconnecting", NoticeLost: "lost", NoticeFailed: "failed"}[e.Notify])
	add(e.StartPreparing, "start_preparing")
	return f
}

func TestEveryStateEventPair(t *testing.T) {
	t.Parallel()
	evs, sts := events(), states()
	require.Len(t, sts, len(States))
	require.Len(t, table, len(States))
	for sname, r := range sts {
		require.Len(t, table[sname], len(evs), sname)
		for ename, ev := range evs {
			t.Run(sname+"/"+ename, func(t *testing.T) {
				want := strings.Fields(table[sname][ename])
				require.NotEmpty(t, want)
				got, eff := Apply(r, ev)
				require.Equal(t, want[1:], flags(eff), "effects")
				if want[0] == "=" {
					require.Equal(t, r, got)
					return
				}
				name := want[0]
				if name == "absent" {
					name = ""
				}
				require.Equal(t, State(name), got.State)
			})
		}
	}
}

func TestTransitionDetails(t *testing.T) {
	t.Parallel()
	s := states()
	t.Run("a record of another directory is not moved", func(t *testing.T) {
		for _, name := range []string{"unknown", "preparing", "ready", "reconnecting", "failed"} {
			got, eff := Apply(s[name], Prepare{Directory: "/other"})
			require.Equal(t, s[name], got, name)
			require.ErrorIs(t, eff.Err, ErrDirectoryMoved, name)
			require.Equal(t, []string{"err"}, flags(eff), name)
		}
		got, eff := Apply(s["released"], Prepare{Directory: "/other"})
		require.Equal(t, Route{State: Preparing, Directory: "/other", Step: StepAllocate}, got)
		require.NoError(t, eff.Err)
	})
	t.Run("a new route starts from nothing", func(t *testing.T) {
		got, _ := Apply(s["released"], Prepare{Directory: "/d"})
		require.Equal(t, Route{State: Preparing, Directory: "/d", Step: StepAllocate}, got)
	})
	t.Run("a route prepared again keeps its runtime session", func(t *testing.T) {
		// After a suspend, an idle stop or a lost wrapper the agent loads
		// the same conversation: one runtime session, one history.
		for _, name := range []string{"unknown", "failed"} {
			got, _ := Apply(s[name], Prepare{Directory: "/d"})
			require.Equal(t, Route{State: Preparing, Directory: "/d", Step: StepAllocate, RuntimeSessionID: "rs1"}, got, name)
			got, _ = Apply(got, PrepareSent{Contract: scope.PerSession, RuntimeSessionID: "rs2"})
			require.Equal(t, "rs1", got.RuntimeSessionID, name)
		}
	})
	t.Run("a resume whose state is lost continues only by an explicit restart", func(t *testing.T) {
		lost := s["failed"]
		lost.FailureReason, lost.Retryable, lost.Served = ReasonResumeStateLost, false, true
		again, _ := Apply(lost, Prepare{Directory: "/d"})
		require.Equal(t, Route{State: Preparing, Directory: "/d", Step: StepAllocate, RuntimeSessionID: "rs1", Served: true}, again,
			"without restart the launch checks the state again")
		fresh, eff := Apply(lost, Prepare{Directory: "/d", Restart: true})
		require.Equal(t, Route{State: Preparing, Directory: "/d", Step: StepAllocate, Restart: true}, fresh,
			"a new conversation: no runtime session yet, nothing served, a fresh home")
		require.True(t, eff.Persist)
		fresh, _ = Apply(fresh, PrepareSent{Contract: scope.PerSession, RuntimeSessionID: "rs2"})
		failedAgain, _ := Apply(fresh, RouteFailed{Reason: "capacity_rejected", Retryable: true})
		retried, _ := Apply(failedAgain, Prepare{Directory: "/d"})
		require.True(t, retried.Restart, "a restart that failed on the way is still one")
		ready, _ := Apply(retried, RouteReady{RuntimeKey: "", Instance: "i2", RuntimeSessionID: "rs2"})
		require.True(t, ready.Served)
		require.False(t, ready.Restart, "done once ready")
		require.Equal(t, "rs2", ready.RuntimeSessionID)

		other := s["failed"] // capacity_rejected
		other.Served = true
		got, _ := Apply(other, Prepare{Directory: "/d", Restart: true})
		require.Equal(t, Route{State: Preparing, Directory: "/d", Step: StepAllocate, RuntimeSessionID: "rs1", Served: true}, got,
			"restart changes nothing of a route that did not lose its state")
	})
	t.Run("a recovery that removed only recreatable state leaves nothing to lose", func(t *testing.T) {
		for _, name := range []string{"unknown", "preparing", "failed"} {
			r := s[name]
			r.Served = true
			got, eff := Apply(r, Recreated{})
			require.False(t, got.Served, name)
			require.Equal(t, []string{"persist"}, flags(eff), name)
		}
	})
	t.Run("preparation keys, steps and names the runtime session once", func(t *testing.T) {
		r, _ := Apply(Route{}, Prepare{Directory: "/d"})
		r, _ = Apply(r, Keyed{RuntimeKey: "/d", Contract: scope.Unpinned})
		r, _ = Apply(r, StepReached{Step: StepWaitForWrapper})
		require.Equal(t, Route{State: Preparing, Directory: "/d", Step: StepWaitForWrapper, RuntimeKey: "/d"}, r)
		r, _ = Apply(r, PrepareSent{Contract: scope.Worktree, RuntimeSessionID: "rs1"})
		r, _ = Apply(r, PrepareSent{Contract: scope.Worktree, RuntimeSessionID: "rs2"})
		require.Equal(t, "rs1", r.RuntimeSessionID)
		require.Equal(t, scope.Worktree, r.Contract, "the serving wrapper's contract, not the keyed one")
		require.Equal(t, StepPrepareRoute, r.Step)
	})
	t.Run("route ready clears the failure and records the serving wrapper", func(t *testing.T) {
		got, _ := Apply(s["failed"], RouteReady{RuntimeKey: "k1", Instance: "i2", RuntimeSessionID: "rs2"})
		require.Equal(t, Route{State: Ready, Directory: "/d", RuntimeKey: "k1", Contract: scope.PerSession, WrapperInstance: "i2", RuntimeSessionID: "rs2", Retryable: true, Served: true}, got)
	})
	t.Run("another runtime key changes nothing", func(t *testing.T) {
		for _, ev := range []Event{
			WrapperHello{RuntimeKey: "k2", Instance: "i1", Kept: true, RuntimeSessionID: "rs2"},
			RouteReady{RuntimeKey: "k2", Instance: "i1", RuntimeSessionID: "rs2"},
			RouteFailed{RuntimeKey: "k2", Reason: "boom"}, StreamClosed{RuntimeKey: "k2"},
			WrapperStopping{RuntimeKey: "k2", Reason: "idle"}, WrapperGone{RuntimeKey: "k2", Reason: "gone"},
		} {
			for name, r := range s {
				got, eff := Apply(r, ev)
				require.Equal(t, r, got, name)
				require.Empty(t, flags(eff), name)
			}
		}
	})
	t.Run("a hello of another instance re-prepares and drops the handle", func(t *testing.T) {
		for _, name := range []string{"preparing", "reconnecting"} {
			got, eff := Apply(s[name], WrapperHello{RuntimeKey: "k1", Instance: "i2", Kept: true, RuntimeSessionID: "rs2"})
			require.Equal(t, Preparing, got.State, name)
			require.Equal(t, StepPrepareRoute, got.Step, name)
			require.Equal(t, []string{"persist", "drop", "restarted", "send_prepare"}, flags(eff), name)
		}
		got, eff := Apply(s["ready"], WrapperHello{RuntimeKey: "k1", Instance: "i2", Kept: true, RuntimeSessionID: "rs2"})
		require.Equal(t, s["ready"], got, "a ready route stays ready (see the package doc)")
		require.Empty(t, flags(eff))
	})
	t.Run("a hello that does not keep the route re-prepares it", func(t *testing.T) {
		got, eff := Apply(s["reconnecting"], WrapperHello{RuntimeKey: "k1", Instance: "i1"})
		require.Equal(t, Preparing, got.State)
		require.Equal(t, []string{"persist", "send_prepare"}, flags(eff))
	})
	t.Run("failure and loss carry their reason", func(t *testing.T) {
		_, eff := Apply(s["preparing"], WrapperStopping{RuntimeKey: "k1", Reason: "startup_timeout"})
		require.Equal(t, "startup_timeout", eff.Reason)
		require.True(t, eff.Retryable)
		got, eff := Apply(s["preparing"], RouteFailed{RuntimeKey: "k1", Reason: "runtime_contract_downgrade"})
		require.Equal(t, "runtime_contract_downgrade", got.FailureReason)
		require.False(t, got.Retryable)
		require.False(t, eff.Retryable)
		_, eff = Apply(s["ready"], WrapperGone{RuntimeKey: "k1", Reason: "wrapper_exited"})
		require.Equal(t, "wrapper_exited", eff.Reason)
	})
	t.Run("release without a credential service has nothing pending", func(t *testing.T) {
		got, _ := Apply(s["ready"], Release{})
		require.False(t, got.MemberReleasePending)
		_, eff := Apply(got, MemberReleased{})
		require.Empty(t, flags(eff))
	})
	t.Run("queries", func(t *testing.T) {
		live := map[string]bool{"preparing": true, "ready": true, "reconnecting": true}
		member := map[string]bool{"unknown": true, "preparing": true, "ready": true, "reconnecting": true}
		for name, r := range s {
			require.Equal(t, live[name], r.Live(), name)
			require.Equal(t, member[name], r.Member(), name)
			require.Equal(t, name == "ready", r.Deliverable(), name)
		}
	})
}

// allowed lists the state changes the machine may make; anything else is a bug.
var allowed = map[State][]State{
	Absent:       {Preparing},
	Unknown:      {Preparing, Ready, Failed, Released},
	Preparing:    {Ready, Failed, Released},
	Ready:        {Reconnecting, Unknown, Failed, Released},
	Reconnecting: {Ready, Preparing, Unknown, Failed, Released},
	Failed:       {Preparing, Ready, Released},
	Released:     {Preparing, Absent},
}

func randomEvent(rng *rand.Rand) Event {
	pick := func(xs ...string) string { return xs[rng.IntN(len(xs))] }
	key := func() string { return pick("k1", "k2") }
	inst := func() string { return pick("i1", "i2") }
	rsid := func() string { return pick("rs1", "rs2") }
	switch rng.IntN(15) {
	case 0:
		return Prepare{Directory: pick("/a", "/b")}
	case 1:
		return Keyed{RuntimeKey: key(), Contract: scope.Contract(pick("", "per_session", "worktree"))}
	case 2:
		return StepReached{Step: pick(StepCreateSandbox, StepWaitForWrapper, StepWaitForCleanup)}
	case 3:
		return PrepareSent{Contract: scope.Contract(pick("per_session", "worktree")), RuntimeSessionID: rsid()}
	case 4:
		return WrapperHello{RuntimeKey: key(), Instance: inst(), Kept: rng.IntN(2) == 0, RuntimeSessionID: rsid()}
	case 5:
		return RouteReady{RuntimeKey: key(), Instance: inst(), RuntimeSessionID: rsid()}
	case 6:
		return RouteFailed{RuntimeKey: pick("", "k1", "k2"), Reason: pick("boom", "capacity_rejected"), Retryable: rng.IntN(2) == 0}
	case 7:
		return StreamClosed{RuntimeKey: key()}
	case 8:
		return OwnerResumed{}
	case 9:
		return KeyStopped{}
	case 10:
		return WrapperStopping{RuntimeKey: key(), Reason: "idle"}
	case 11:
		return WrapperGone{RuntimeKey: key(), Reason: "wrapper_exited"}
	case 12:
		return Release{Credentials: rng.IntN(2) == 0}
	case 13:
		return MemberReleased{}
	}
	return Forget{}
}

// TestProperties drives random event sequences through a caller that
// performs the effects the way the driver does (an admission may refuse a
// new route) and checks the invariants after every step.
func TestProperties(t *testing.T) {
	t.Parallel()
	seen := map[State]bool{}
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 24))
		var r Route
		for step := range 200 {
			ev := randomEvent(rng)
			next, eff := Apply(r, ev)
			again, eff2 := Apply(r, ev)
			require.Equal(t, next, again, "seed %d step %d: pure", seed, step)
			require.Equal(t, eff, eff2, "seed %d step %d: pure", seed, step)
			changed := next != r
			if changed {
				require.True(t, eff.Persist || eff.Delete, "seed %d step %d: every change is written (%T)", seed, step, ev)
			}
			if next.State != r.State {
				require.Contains(t, allowed[r.State], next.State, "seed %d step %d: %s → %s on %T", seed, step, r.State, next.State, ev)
			}
			if eff.Err != nil {
				require.False(t, changed, "seed %d step %d: a refusal changes nothing", seed, step)
				require.Equal(t, []string{"err"}, flags(eff))
			}
			if eff.Delete {
				require.Equal(t, Released, r.State)
				require.Equal(t, Route{}, next)
			}
			if eff.Notify != NoticeNone {
				require.True(t, eff.Persist, "seed %d step %d: nothing is announced that was not written", seed, step)
				want := map[Notice]State{NoticeReady: Ready, NoticeReconnecting: Reconnecting, NoticeLost: Unknown, NoticeFailed: Failed}[eff.Notify]
				require.Equal(t, want, next.State, "seed %d step %d: notice matches the state", seed, step)
			}
			if eff.Admit && rng.IntN(4) == 0 {
				continue // the scope refused the session: the new route is discarded
			}
			r = next
			seen[r.State] = true
			require.True(t, r.Step == "" || r.State == Preparing, "seed %d step %d: only a preparing route has a step", seed, step)
			require.True(t, r.FailureReason == "" || r.State == Failed || r.State == Released, "seed %d step %d: failure reason on %s", seed, step, r.State)
			require.True(t, !r.MemberReleasePending || r.State == Released, "seed %d step %d: pending member release on %s", seed, step, r.State)
			if r.State == Ready {
				require.NotEmpty(t, r.WrapperInstance, "seed %d step %d", seed, step)
				require.NotEmpty(t, r.RuntimeSessionID, "seed %d step %d", seed, step)
			}
			if r.State == Absent {
				require.Equal(t, Route{}, r)
			}
		}
	}
	for _, s := range States {
		require.True(t, seen[s], "the random walk never reached %q", s)
	}
}

// sendPrepare's frame goes out whatever the route reached meanwhile: the
// record names the contract and runtime session id it carries, and only a
// preparing route takes the step.
func TestPrepareSentOnARouteThatMovedOn(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"unknown", "ready", "reconnecting", "failed", "released"} {
		r := states()[name]
		r.RuntimeSessionID = ""
		got, eff := Apply(r, PrepareSent{Contract: scope.Worktree, RuntimeSessionID: "rs9"})
		require.Equal(t, []string{"persist"}, flags(eff), name)
		require.Equal(t, r.State, got.State, name)
		require.Equal(t, r.Step, got.Step, name)
		require.Equal(t, scope.Worktree, got.Contract, name)
		require.Equal(t, "rs9", got.RuntimeSessionID, name)
	}
}
