package allocation

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

func TestLifecycle(t *testing.T) {
	t.Parallel()
	tm := DefaultTimers()
	a := Apply(tm, Allocation{}, Create{Now: t0})
	require.Equal(t, Creating, a.Phase)
	a = Apply(tm, a, Created{Now: t0})
	a = Apply(tm, a, Launched{Now: t0, Instance: "w1"})
	require.Equal(t, Starting, a.Phase)
	require.Equal(t, t0.Add(5*time.Minute), a.Deadline)

	require.Equal(t, Starting, Apply(tm, a, Hello{Now: t0, Instance: "other"}).Phase, "hello of another instance")
	a = Apply(tm, a, Hello{Now: t0.Add(time.Second), Instance: "w1"})
	require.Equal(t, Connected, a.Phase)

	a = Apply(tm, a, Heartbeat{Now: t0.Add(40 * time.Second)})
	require.Equal(t, Connected, Apply(tm, a, Tick{Now: t0.Add(84 * time.Second)}).Phase)
	d := Apply(tm, a, Tick{Now: t0.Add(85 * time.Second)})
	require.Equal(t, Disconnected, d.Phase)
	require.Equal(t, ReasonHeartbeatLost, d.Reason)

	// Reconnect inside the window.
	r := Apply(tm, d, Hello{Now: t0.Add(100 * time.Second), Instance: "w1"})
	require.Equal(t, Connected, r.Phase)

	// Past the window: stop.
	s := Apply(tm, d, Tick{Now: t0.Add(85*time.Second + 90*time.Second)})
	require.Equal(t, Stopping, s.Phase)
	require.Equal(t, ReasonReconnectWindow, s.Reason)
	require.Equal(t, Stopped, Apply(tm, s, StopVerified{Now: t0}).Phase)
}

func TestTimeouts(t *testing.T) {
	t.Parallel()
	tm := DefaultTimers()
	c := Apply(tm, Allocation{}, Create{Now: t0})
	require.Equal(t, ReasonCreateTimeout, Apply(tm, c, Tick{Now: t0.Add(2 * time.Minute)}).Reason)
	s := Apply(tm, Allocation{}, Launched{Now: t0, Instance: "w"})
	require.Equal(t, Starting, Apply(tm, s, Tick{Now: t0.Add(5*time.Minute - 1)}).Phase)
	require.Equal(t, ReasonHelloTimeout, Apply(tm, s, Tick{Now: t0.Add(5 * time.Minute)}).Reason)

	// Idle stop counts activity, not heartbeats.
	a := Apply(tm, s, Hello{Now: t0, Instance: "w"})
	for i := 1; i <= 120; i++ {
		a = Apply(tm, a, Heartbeat{Now: t0.Add(time.Duration(i) * 5 * time.Second)})
		a = Apply(tm, a, Tick{Now: t0.Add(time.Duration(i) * 5 * time.Second)})
	}
	require.Equal(t, Stopping, a.Phase)
	require.Equal(t, ReasonIdle, a.Reason)
}

func TestStreamClosedAndStop(t *testing.T) {
	t.Parallel()
	tm := DefaultTimers()
	a := Apply(tm, Apply(tm, Allocation{}, Launched{Now: t0, Instance: "w"}), Hello{Now: t0, Instance: "w"})
	require.Equal(t, Connected, Apply(tm, a, StreamClosed{Now: t0, Instance: "old"}).Phase, "stale stream")
	d := Apply(tm, a, StreamClosed{Now: t0, Instance: "w"})
	require.Equal(t, Disconnected, d.Phase)
	require.Equal(t, t0.Add(90*time.Second), d.Deadline)
	st := Apply(tm, d, Stop{Now: t0, Reason: "session-delete"})
	require.Equal(t, Stopping, st.Phase)
	require.Equal(t, st, Apply(tm, st, Stop{Now: t0, Reason: "again"}), "stop is idempotent")
	require.Equal(t, Allocation{}, Apply(tm, Allocation{}, Heartbeat{Now: t0}))
}

// Property: no event sequence leaves the known phases, and Stopped is only
// reached through Stopping.
func TestPhasesClosed(t *testing.T) {
	t.Parallel()
	tm := DefaultTimers()
	events := []func(time.Time) any{
		func(n time.Time) any { return Create{Now: n} }, func(n time.Time) any { return Created{Now: n} },
		func(n time.Time) any { return Launched{Now: n, Instance: "w"} }, func(n time.Time) any { return Hello{Now: n, Instance: "w"} },
		func(n time.Time) any { return Heartbeat{Now: n} }, func(n time.Time) any { return StreamClosed{Now: n, Instance: "w"} },
		func(n time.Time) any { return Stop{Now: n, Reason: "x"} }, func(n time.Time) any { return StopVerified{Now: n} },
		func(n time.Time) any { return Tick{Now: n} },
	}
	for seed := range 2000 {
		a, now, x := Allocation{}, t0, uint32(seed*2654435761+1)
		for range 30 {
			x ^= x << 13
			x ^= x >> 17
			x ^= x << 5
			now = now.Add(time.Duration(x%200) * time.Second)
			prev := a
			a = Apply(tm, a, events[x%uint32(len(events))](now))
			require.Contains(t, []Phase{"", Stopped, Creating, Starting, Connected, Disconnected, Stopping}, a.Phase)
			if a.Phase == Stopped && prev.Phase != Stopped {
				require.Equal(t, Stopping, prev.Phase)
			}
		}
	}
}
