// Package allocation is the pure allocation state machine of DESIGN.md 3.2:
//
//	stopped → creating → starting → connected ⇄ disconnected → stopping → stopped
//
// One Allocation tracks the wrapper life of one runtime key of a sandbox:
// the provider creates the sandbox, a wrapper is launched, it says Hello,
// heartbeats keep it connected, a dropped stream opens the reconnect window.
// Apply has no I/O: time comes in the events, effects go out as a Reason.
package allocation

import "time"

// Phase is the allocation state.
type Phase string

const (
	Stopped      Phase = "stopped"
	Creating     Phase = "creating"
	Starting     Phase = "starting"
	Connected    Phase = "connected"
	Disconnected Phase = "disconnected"
	Stopping     Phase = "stopping"
)

// Timers are the bounds of DESIGN.md 3.2 (all configurable).
type Timers struct {
	Create          time.Duration // create call bound (2 min)
	FirstHello      time.Duration // launch → Hello (5 min)
	Heartbeat       time.Duration // wrapper heartbeat interval (5 s)
	DeadAfter       time.Duration // connected without a heartbeat → disconnected (45 s)
	ReconnectWindow time.Duration // disconnected → stop (90 s)
	IdleStop        time.Duration // connected without activity → stop (10 min)
}

// DefaultTimers are the DESIGN.md numbers.
func DefaultTimers() Timers {
	return Timers{
		Create: 2 * time.Minute, FirstHello: 5 * time.Minute, Heartbeat: 5 * time.Second,
		DeadAfter: 45 * time.Second, ReconnectWindow: 90 * time.Second, IdleStop: 10 * time.Minute,
	}
}

// Allocation is the state of one runtime key's wrapper allocation (store.KeyAllocation keeps it).
type Allocation struct {
	Phase         Phase     `json:"phase"`
	Deadline      time.Time `json:"deadline,omitzero"`       // of creating, starting, disconnected
	LastHeartbeat time.Time `json:"last_heartbeat,omitzero"` // connected
	LastActivity  time.Time `json:"last_activity,omitzero"`  // deliveries, outcomes, routes
	Instance      string    `json:"instance,omitempty"`      // the wrapper launched or connected
	Reason        string    `json:"reason,omitempty"`        // why the last stop or disconnect happened
}

// Events.
type (
	Create   struct{ Now time.Time }
	Created  struct{ Now time.Time }
	Launched struct {
		Now      time.Time
		Instance string
	}
	Hello struct {
		Now      time.Time
		Instance string
	}
	Heartbeat    struct{ Now time.Time }
	Activity     struct{ Now time.Time }
	StreamClosed struct {
		Now      time.Time
		Instance string
	}
	Stop struct {
		Now    time.Time
		Reason string
	}
	StopVerified struct{ Now time.Time }
	Tick         struct{ Now time.Time }
)

// Reasons for timer-driven changes.
const (
	ReasonCreateTimeout   = "create_timeout"
	ReasonHelloTimeout    = "wrapper_start_timeout"
	ReasonHeartbeatLost   = "heartbeat_lost"
	ReasonStreamClosed    = "stream_closed"
	ReasonReconnectWindow = "reconnect_window_expired"
	ReasonIdle            = "idle"
)

// Apply returns the allocation after ev. An event that does not apply to the
// current phase (or names another wrapper instance) leaves it unchanged.
func Apply(t Timers, a Allocation, ev any) Allocation {
	switch e := ev.(type) {
	case Create:
		if a.Phase == Stopped || a.Phase == "" {
			return Allocation{Phase: Creating, Deadline: e.Now.Add(t.Create), LastActivity: e.Now}
		}
	case Created:
		if a.Phase == Creating {
			a.Deadline = time.Time{}
			return a
		}
	case Launched:
		if a.Phase == Creating || a.Phase == Stopped || a.Phase == "" {
			return Allocation{Phase: Starting, Deadline: e.Now.Add(t.FirstHello), Instance: e.Instance, LastActivity: e.Now}
		}
	case Hello:
		if (a.Phase == Starting || a.Phase == Disconnected || a.Phase == Connected) && e.Instance == a.Instance {
			a.Phase, a.Deadline, a.LastHeartbeat, a.LastActivity, a.Reason = Connected, time.Time{}, e.Now, later(a.LastActivity, e.Now), ""
			return a
		}
	case Heartbeat:
		if a.Phase == Connected {
			a.LastHeartbeat = e.Now
		}
	case Activity:
		if a.Phase == Connected || a.Phase == Starting || a.Phase == Disconnected {
			a.LastActivity = later(a.LastActivity, e.Now)
		}
	case StreamClosed:
		if a.Phase == Connected && e.Instance == a.Instance {
			return disconnect(t, a, e.Now, ReasonStreamClosed)
		}
	case Stop:
		if a.Phase != Stopped && a.Phase != Stopping && a.Phase != "" {
			a.Phase, a.Deadline, a.Reason = Stopping, time.Time{}, e.Reason
		}
	case StopVerified:
		if a.Phase == Stopping {
			return Allocation{Phase: Stopped, Reason: a.Reason}
		}
	case Tick:
		return tick(t, a, e.Now)
	}
	return a
}

func tick(t Timers, a Allocation, now time.Time) Allocation {
	switch a.Phase {
	case Creating:
		if !a.Deadline.IsZero() && !now.Before(a.Deadline) {
			a.Phase, a.Reason = Stopping, ReasonCreateTimeout
		}
	case Starting:
		if !now.Before(a.Deadline) {
			a.Phase, a.Deadline, a.Reason = Stopping, time.Time{}, ReasonHelloTimeout
		}
	case Connected:
		switch {
		case now.Sub(a.LastHeartbeat) >= t.DeadAfter:
			return disconnect(t, a, now, ReasonHeartbeatLost)
		case t.IdleStop > 0 && now.Sub(a.LastActivity) >= t.IdleStop:
			a.Phase, a.Reason = Stopping, ReasonIdle
		}
	case Disconnected:
		if !now.Before(a.Deadline) {
			a.Phase, a.Deadline, a.Reason = Stopping, time.Time{}, ReasonReconnectWindow
		}
	}
	return a
}

func disconnect(t Timers, a Allocation, now time.Time, reason string) Allocation {
	a.Phase, a.Deadline, a.Reason = Disconnected, now.Add(t.ReconnectWindow), reason
	return a
}

// Live reports whether a wrapper may be running or coming up.
func (a Allocation) Live() bool {
	return a.Phase == Creating || a.Phase == Starting || a.Phase == Connected || a.Phase == Disconnected
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
