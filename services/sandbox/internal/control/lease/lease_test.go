package lease

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var (
	p  = DefaultPolicy()
	t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
)

// One lease per state of DESIGN.md 3.2 (exhausted is stop_needed's sub-state).
func states() map[string]Lease {
	return map[string]Lease{
		"none":         {State: None, NextGeneration: 3, LastAttempt: 7},
		"owns_wrapper": {State: OwnsWrapper, NextGeneration: 4, Instance: "i1", Generation: 3, StopAfter: t0.Add(time.Minute), LastAttempt: 7},
		"stop_needed":  {State: StopNeeded, NextGeneration: 4, Attempts: 1, LastAttempt: 7, NextAttemptAt: t0},
		"exhausted":    {State: StopNeeded, Exhausted: true, ExhaustedAt: t0.Add(-time.Minute), NextGeneration: 4, Attempts: 5, LastAttempt: 7, NextAttemptAt: t0},
		"stopping":     {State: Stopping, NextGeneration: 4, Attempts: 2, LastAttempt: 7, WatchdogAt: t0},
	}
}

// Events that apply when they can: the owned instance, the next/current
// attempt, now = t0 (every deadline above is due at t0).
func events() map[string]Event {
	return map[string]Event{
		"allocate":           Allocate{Instance: "i2", Now: t0},
		"startup_verified":   StartupVerified{Instance: "i1", Now: t0},
		"delivery_accepted":  DeliveryAccepted{Instance: "i1", Now: t0},
		"retain_warm":        RetainWarm{Instance: "i1", Until: t0.Add(time.Hour)},
		"reuse":              Reuse{Instance: "i1", Now: t0},
		"owned_absent":       OwnedAbsent{Instance: "i1"},
		"request_stop":       RequestStop{Reason: "session-delete", Now: t0},
		"begin_stop_attempt": BeginStopAttempt{Attempt: 8, Now: t0},
		"stop_absent":        StopAbsent{Attempt: 7},
		"stop_not_confirmed": StopNotConfirmed{Attempt: 7, Now: t0},
		"attempt_expired":    AttemptExpired{Now: t0},
		"cleanup_exhausted":  CleanupExhausted{Now: t0},
	}
}

// Expected state after each (state, event); "=" means unchanged.
var table = map[string]map[string]string{
	"none": {
		"allocate": "owns_wrapper", "startup_verified": "=", "delivery_accepted": "=", "retain_warm": "=",
		"reuse": "=", "owned_absent": "=", "request_stop": "stop_needed", "begin_stop_attempt": "=",
		"stop_absent": "=", "stop_not_confirmed": "=", "attempt_expired": "=", "cleanup_exhausted": "=",
	},
	"owns_wrapper": {
		"allocate": "=", "startup_verified": "owns_wrapper", "delivery_accepted": "owns_wrapper", "retain_warm": "owns_wrapper",
		"reuse": "owns_wrapper", "owned_absent": "none", "request_stop": "stop_needed", "begin_stop_attempt": "=",
		"stop_absent": "=", "stop_not_confirmed": "=", "attempt_expired": "=", "cleanup_exhausted": "=",
	},
	"stop_needed": {
		"allocate": "=", "startup_verified": "=", "delivery_accepted": "=", "retain_warm": "=",
		"reuse": "=", "owned_absent": "=", "request_stop": "=", "begin_stop_attempt": "stopping",
		"stop_absent": "=", "stop_not_confirmed": "=", "attempt_expired": "=", "cleanup_exhausted": "=",
	},
	"exhausted": {
		"allocate": "=", "startup_verified": "=", "delivery_accepted": "=", "retain_warm": "=",
		"reuse": "=", "owned_absent": "=", "request_stop": "=", "begin_stop_attempt": "stopping",
		"stop_absent": "=", "stop_not_confirmed": "=", "attempt_expired": "=", "cleanup_exhausted": "=",
	},
	"stopping": {
		"allocate": "=", "startup_verified": "=", "delivery_accepted": "=", "retain_warm": "=",
		"reuse": "=", "owned_absent": "=", "request_stop": "=", "begin_stop_attempt": "=",
		"stop_absent": "none", "stop_not_confirmed": "stop_needed", "attempt_expired": "stop_needed", "cleanup_exhausted": "=",
	},
}

func TestEveryStateEventPair(t *testing.T) {
	t.Parallel()
	evs := events()
	for sname, l := range states() {
		require.Len(t, table[sname], len(evs), sname)
		for ename, ev := range evs {
			t.Run(sname+"/"+ename, func(t *testing.T) {
				want, ok := table[sname][ename]
				require.True(t, ok)
				got := Apply(p, l, ev)
				if want == "=" {
					require.Equal(t, l, got)
					return
				}
				require.Equal(t, State(want), got.State)
				require.GreaterOrEqual(t, got.NextGeneration, l.NextGeneration)
				require.GreaterOrEqual(t, got.LastAttempt, l.LastAttempt)
			})
		}
	}
}

func TestTransitionDetails(t *testing.T) {
	t.Parallel()
	s := states()
	t.Run("allocate takes the next generation", func(t *testing.T) {
		got := Apply(p, s["none"], Allocate{Instance: "i2", Now: t0})
		require.Equal(t, uint64(3), got.Generation)
		require.Equal(t, uint64(4), got.NextGeneration)
		require.Equal(t, t0.Add(10*time.Minute), got.StopAfter)
	})
	t.Run("startup verified shrinks the deadline to 60s", func(t *testing.T) {
		l := Apply(p, s["none"], Allocate{Instance: "i2", Now: t0})
		got := Apply(p, l, StartupVerified{Instance: "i2", Now: t0.Add(time.Minute)})
		require.True(t, got.Verified)
		require.Equal(t, t0.Add(2*time.Minute), got.StopAfter)
		got = Apply(p, got, DeliveryAccepted{Instance: "i2", Now: t0.Add(2 * time.Minute)})
		require.Equal(t, t0.Add(17*time.Minute), got.StopAfter, "idle 15 min")
		got = Apply(p, got, RetainWarm{Instance: "i2", Until: t0.Add(5 * time.Minute)})
		require.Equal(t, t0.Add(17*time.Minute), got.StopAfter, "keep-warm never shortens")
	})
	t.Run("stale instance changes nothing", func(t *testing.T) {
		for _, ev := range []Event{
			StartupVerified{Instance: "old", Now: t0}, DeliveryAccepted{Instance: "old", Now: t0},
			RetainWarm{Instance: "old", Until: t0.Add(time.Hour)}, Reuse{Instance: "old", Now: t0}, OwnedAbsent{Instance: "old"},
			OwnedAbsent{Instance: ""},
		} {
			require.Equal(t, s["owns_wrapper"], Apply(p, s["owns_wrapper"], ev))
		}
	})
	t.Run("stale attempt changes nothing", func(t *testing.T) {
		for _, ev := range []Event{StopAbsent{Attempt: 6}, StopNotConfirmed{Attempt: 6, Now: t0}, StopAbsent{Attempt: 8}} {
			require.Equal(t, s["stopping"], Apply(p, s["stopping"], ev))
		}
		// A replayed or older begin never starts an attempt.
		require.Equal(t, s["stop_needed"], Apply(p, s["stop_needed"], BeginStopAttempt{Attempt: 7, Now: t0}))
	})
	t.Run("begin only when due", func(t *testing.T) {
		require.Equal(t, s["stop_needed"], Apply(p, s["stop_needed"], BeginStopAttempt{Attempt: 8, Now: t0.Add(-time.Nanosecond)}))
		got := Apply(p, s["stop_needed"], BeginStopAttempt{Attempt: 8, Now: t0})
		require.Equal(t, 2, got.Attempts)
		require.Equal(t, t0.Add(45*time.Second), got.WatchdogAt)
	})
	t.Run("attempt expires only after the watchdog", func(t *testing.T) {
		l := s["stopping"]
		l.WatchdogAt = t0.Add(time.Second)
		require.Equal(t, l, Apply(p, l, AttemptExpired{Now: t0}))
		require.Equal(t, StopNeeded, Apply(p, l, AttemptExpired{Now: t0.Add(time.Second)}).State)
	})
	t.Run("cleanup_exhausted after max attempts", func(t *testing.T) {
		l := s["stop_needed"]
		l.Attempts = 5
		got := Apply(p, l, CleanupExhausted{Now: t0})
		require.True(t, got.Exhausted)
		require.Equal(t, t0.Add(10*time.Second), got.NextAttemptAt, "the first recheck comes soon")
	})
}

// The persisted backoff: 5, 10, 10, 10 s measured from the observed result,
// exhausted after 5 attempts, rechecks at +10 s then doubling intervals up to
// every 10 min, for 60 min (issue 33 item 7: start short, back off), then
// only a final observation; release only on observed absence.
func TestBackoffSchedule(t *testing.T) {
	t.Parallel()
	l := Apply(p, Lease{}, RequestStop{Reason: "x", Now: t0})
	now := t0
	var delays []time.Duration
	for i := 1; i <= 5; i++ {
		l = Apply(p, l, BeginStopAttempt{Attempt: uint64(i), Now: now})
		require.Equal(t, Stopping, l.State)
		now = now.Add(3 * time.Second) // result observed 3 s later
		l = Apply(p, l, StopNotConfirmed{Attempt: uint64(i), Now: now})
		require.Equal(t, StopNeeded, l.State)
		delays = append(delays, l.NextAttemptAt.Sub(now))
		now = l.NextAttemptAt
	}
	require.Equal(t, []time.Duration{5 * time.Second, 10 * time.Second, 10 * time.Second, 10 * time.Second, 10 * time.Second}, delays)
	require.True(t, l.Exhausted)
	exhaustedAt := l.ExhaustedAt
	var begins []time.Duration
	var lastBegin time.Time
	for !l.NextAttemptAt.IsZero() {
		begins = append(begins, l.NextAttemptAt.Sub(exhaustedAt))
		a := l.LastAttempt + 1
		lastBegin = l.NextAttemptAt
		l = Apply(p, l, BeginStopAttempt{Attempt: a, Now: l.NextAttemptAt})
		require.Equal(t, Stopping, l.State)
		l = Apply(p, l, StopNotConfirmed{Attempt: a, Now: l.WatchdogAt.Add(-44 * time.Second)})
		require.True(t, l.Exhausted)
		require.False(t, l.FinalObserved)
	}
	s := time.Second
	require.Equal(t, []time.Duration{10 * s, 30 * s, 70 * s, 150 * s, 310 * s, 630 * s, 1230 * s, 1830 * s, 2430 * s, 3030 * s}, begins,
		"10 s, then doubling up to every 10 min, within 60 min")
	require.LessOrEqual(t, lastBegin.Sub(exhaustedAt), 60*time.Minute)
	// Outside the schedule only a Final attempt runs; its failure is recorded.
	require.Equal(t, l, Apply(p, l, BeginStopAttempt{Attempt: l.LastAttempt + 1, Now: now.Add(24 * time.Hour)}))
	l = Apply(p, l, BeginStopAttempt{Attempt: l.LastAttempt + 1, Now: now.Add(24 * time.Hour), Final: true})
	require.Equal(t, Stopping, l.State)
	l2 := Apply(p, l, StopNotConfirmed{Attempt: l.LastAttempt, Now: now.Add(24 * time.Hour)})
	require.True(t, l2.FinalObserved)
	require.Equal(t, StopNeeded, l2.State)
	require.Equal(t, None, Apply(p, l, StopAbsent{Attempt: l.LastAttempt}).State)
}

func TestDue(t *testing.T) {
	t.Parallel()
	s := states()
	ev, ok := Due(s["owns_wrapper"], t0.Add(time.Minute))
	require.True(t, ok)
	require.Equal(t, RequestStop{Reason: ReasonStartupTimeout, Now: t0.Add(time.Minute)}, ev)
	_, ok = Due(s["owns_wrapper"], t0)
	require.False(t, ok)
	ev, _ = Due(s["stop_needed"], t0)
	require.Equal(t, BeginStopAttempt{Attempt: 8, Now: t0}, ev)
	ev, _ = Due(s["stopping"], t0)
	require.Equal(t, AttemptExpired{Now: t0}, ev)
	_, ok = Due(s["none"], t0)
	require.False(t, ok)
}

// Property: over random event sequences, next_generation never decreases,
// events naming a stale instance or attempt change nothing, owns_wrapper
// becomes none only through verified absence, and no attempt id repeats.
func TestProperties(t *testing.T) {
	t.Parallel()
	for seed := range uint64(300) {
		r := rand.New(rand.NewPCG(seed, 42))
		l := Lease{State: None}
		now := t0
		instances := []string{"a", "b", "c", ""}
		for step := 0; step < 200; step++ {
			now = now.Add(time.Duration(r.IntN(120)) * time.Second)
			inst := instances[r.IntN(len(instances))]
			att := l.LastAttempt + uint64(r.IntN(3)) - 1
			if l.LastAttempt == 0 {
				att = uint64(r.IntN(2))
			}
			var ev Event
			switch r.IntN(12) {
			case 0:
				ev = Allocate{Instance: inst, Now: now}
			case 1:
				ev = StartupVerified{Instance: inst, Now: now}
			case 2:
				ev = DeliveryAccepted{Instance: inst, Now: now}
			case 3:
				ev = RetainWarm{Instance: inst, Until: now.Add(time.Duration(r.IntN(600)) * time.Second)}
			case 4:
				ev = Reuse{Instance: inst, Now: now}
			case 5:
				ev = OwnedAbsent{Instance: inst}
			case 6:
				ev = RequestStop{Reason: "r", Now: now}
			case 7:
				ev = BeginStopAttempt{Attempt: att, Now: now, Final: r.IntN(4) == 0}
			case 8:
				ev = StopAbsent{Attempt: att}
			case 9:
				ev = StopNotConfirmed{Attempt: att, Now: now}
			case 10:
				ev = AttemptExpired{Now: now}
			case 11:
				ev = CleanupExhausted{Now: now}
			}
			next := Apply(p, l, ev)
			require.GreaterOrEqual(t, next.NextGeneration, l.NextGeneration, "seed %d step %d", seed, step)
			require.GreaterOrEqual(t, next.LastAttempt, l.LastAttempt)
			switch e := ev.(type) {
			case StartupVerified, DeliveryAccepted, Reuse, OwnedAbsent:
				if instanceOf(e) != l.Instance || l.State != OwnsWrapper {
					require.Equal(t, l, next, "stale instance event %#v", e)
				}
			case RetainWarm:
				if e.Instance != l.Instance || l.State != OwnsWrapper {
					require.Equal(t, l, next)
				}
			case StopAbsent:
				if e.Attempt != l.LastAttempt {
					require.Equal(t, l, next, "stale attempt")
				}
			case StopNotConfirmed:
				if e.Attempt != l.LastAttempt {
					require.Equal(t, l, next, "stale attempt")
				}
			case BeginStopAttempt:
				if e.Attempt <= l.LastAttempt {
					require.Equal(t, l, next, "replayed attempt")
				}
			}
			if l.State == OwnsWrapper && next.State == None {
				_, ok := ev.(OwnedAbsent)
				require.True(t, ok, "owns_wrapper → none only on verified absence, got %#v", ev)
			}
			if l.State == Stopping && next.State == None {
				_, ok := ev.(StopAbsent)
				require.True(t, ok)
			}
			if next.State == OwnsWrapper {
				require.Less(t, next.Generation, next.NextGeneration)
			}
			b, err := Encode(next)
			require.NoError(t, err)
			back, err := Decode(b, now)
			require.NoError(t, err)
			require.True(t, equalLease(next, back), "round trip")
			l = next
		}
	}
}

func instanceOf(ev Event) string {
	switch e := ev.(type) {
	case StartupVerified:
		return e.Instance
	case DeliveryAccepted:
		return e.Instance
	case Reuse:
		return e.Instance
	case OwnedAbsent:
		return e.Instance
	}
	return ""
}

func equalLease(a, b Lease) bool {
	ja, _ := Encode(a)
	jb, _ := Encode(b)
	return string(ja) == string(jb)
}
