// Package route is the sandbox's view of one session's route as a pure
// transition function, like lease and allocation beside it: Apply(route,
// event) returns the next route and the effects the caller must perform
// (persist, notify the session service, send a frame, start preparing). It
// never does I/O. An event that does not apply (wrong state, another runtime
// key) returns the route unchanged and no effects.
//
// States: absent (no record) | preparing | ready | reconnecting | unknown |
// failed | released. The values are the strings store.Route persists today,
// so the record's JSON does not change when the store adopts this type.
//
// Transitions, each named after the driver code it was read from
// (services/sandbox/internal/control/driver; state strings in store/store.go):
//
//	Prepare        absent|unknown|failed|released → preparing(step allocate),
//	               keeping the runtime session id, served and restart of an
//	               unknown or failed route, except that Restart on a route failed
//	               resume_state_lost drops the id and served and sets restart
//	               [Admit, Persist, StartPreparing]; preparing|ready|reconnecting →
//	               unchanged [StartPreparing when preparing]; any record but released
//	               of another directory → unchanged [Err ErrDirectoryMoved]
//	               (routes.go Prepare)
//	Keyed          preparing → preparing with runtime key and contract
//	               [Persist] (routes.go prepare)
//	StepReached    preparing → preparing with the step [Persist]
//	               (routes.go prepare: create_sandbox, wait_for_wrapper;
//	               setStep: wait_for_cleanup)
//	PrepareSent    any record → contract of the serving wrapper, runtime
//	               session id named once, step prepare_route when preparing
//	               [Persist] (routes.go sendPrepare)
//	WrapperHello   ready|reconnecting kept by the same instance → ready
//	               [Persist, Notify ready]; preparing|reconnecting otherwise →
//	               preparing(step prepare_route) [Persist, SendPrepare, and
//	               DropHandle+Restarted when another instance served it]
//	               (conn.go Hello)
//	RouteReady     any recorded state but released, same key → ready, served,
//	               restart done [Persist, JoinScope, Notify ready] (conn.go Frame RouteReady)
//	RouteFailed    any recorded state but released → failed [Persist, Notify
//	               failed] (routes.go failRoute; conn.go Frame RouteFailed and
//	               Hello's contract downgrade; tick.go stopping)
//	StreamClosed   ready → reconnecting [Persist, Notify reconnecting]
//	               (conn.go Disconnected/reconnectingLocked)
//	OwnerResumed   ready → reconnecting [Persist, Notify reconnecting];
//	               preparing → unchanged [StartPreparing] (driver.go resume)
//	KeyStopped     preparing → unchanged [StartPreparing] (tick.go checkStopped;
//	               conn.go Hello's per_session re-key)
//	WrapperStopping ready|reconnecting → unknown [Persist, Notify lost];
//	               preparing → failed retryable [Persist, Notify failed]
//	               (tick.go stopping)
//	WrapperGone    ready|reconnecting → unknown [Persist, Notify lost]
//	               (tick.go checkGone)
//	Release        any recorded state but released → released, member
//	               release pending when a credential service is configured
//	               [Persist, LeaveScope, DropHandle, SendRelease]; released →
//	               unchanged (routes.go ReleaseRoute)
//	MemberReleased released with a pending member release → released
//	               [Persist] (routes.go releaseMember)
//	Forget         released → absent [Delete] (routes.go forgetRoute)
//	Recreated      a served route → not served [Persist]; otherwise unchanged
//	               (recovery.go finishRecovery removed recreatable state)
//
// Wired into the driver with three choices (docs/decisions.md): resume
// persists the ready → reconnecting move it announces; sendPrepare names the
// contract and runtime session id on whatever state the route reached
// meanwhile (the frame goes out anyway) but stamps step prepare_route on a
// preparing route only; a ready route not among a Hello's active routes
// stays ready until a stop or a new stream moves it.
package route

import (
	"errors"

	"agentplane.dev/services/sandbox/internal/control/scope"
)

// State of a route.
type State string

const (
	Absent       State = "" // no record
	Unknown      State = "unknown"
	Preparing    State = "preparing"
	Ready        State = "ready"
	Reconnecting State = "reconnecting"
	Failed       State = "failed"
	Released     State = "released" // kept until the runtime key's absence is verified
)

// States lists every state (for exhaustive tests and metrics).
var States = []State{Absent, Unknown, Preparing, Ready, Reconnecting, Failed, Released}

// Steps of a preparing route, as reported to the session service.
const (
	StepAllocate       = "allocate"
	StepCreateSandbox  = "create_sandbox"
	StepWaitForWrapper = "wait_for_wrapper"
	StepWaitForCleanup = "wait_for_cleanup"
	StepPrepareRoute   = "prepare_route"
)

// ErrDirectoryMoved: a live route is asked for another directory.
var ErrDirectoryMoved = errors.New("route: the session's route is bound to another directory")

// Route is the lifecycle part of a route record: what the transitions read
// and write. The field names and JSON tags are store.Route's, so the store
// can embed it without changing the record.
type Route struct {
	State            State          `json:"state"`
	Directory        string         `json:"directory"`
	Step             string         `json:"step,omitempty"`
	FailureReason    string         `json:"failure_reason,omitempty"`
	Retryable        bool           `json:"retryable,omitempty"`
	RuntimeSessionID string         `json:"runtime_session_id,omitempty"`
	RuntimeKey       string         `json:"runtime_key,omitempty"`
	Contract         scope.Contract `json:"contract,omitempty"`
	WrapperInstance  string         `json:"wrapper_instance,omitempty"`
	// MemberReleasePending: the credential service may still list the
	// session as a scope member; ReleaseMember is retried until it succeeds.
	MemberReleasePending bool `json:"member_release_pending,omitempty"`
	// Served: a runtime served the route, so its workspace and the
	// runtime's home hold what a resume continues (the agent's session
	// store); their loss fails the next launch ReasonResumeStateLost.
	Served bool `json:"served,omitempty"`
	// Restart: the route continues after ReasonResumeStateLost with a new
	// conversation (Prepare.Restart); the launch starts from a fresh home.
	Restart bool `json:"restart,omitempty"`
}

// ReasonResumeStateLost fails a served route whose workspace or runtime
// home is gone when it is launched again (a disk lost, a node replaced):
// never a silent empty agent. Not retryable; Prepare.Restart continues.
const ReasonResumeStateLost = "resume_state_lost"

// Notice is the session-service notification an event calls for.
type Notice int

const (
	NoticeNone Notice = iota
	NoticeReady
	NoticeReconnecting
	NoticeLost
	NoticeFailed
)

// Effects are what the caller performs after a transition, in this order:
// Err (nothing else happened), Admit (before committing a new route: a
// refusal discards it), Persist or Delete, the scope and handle changes,
// the frames, Notify, StartPreparing.
type Effects struct {
	Err            error
	Admit          bool // admit the session to its directory's scope first
	Persist        bool // write the route record
	Delete         bool // delete the route record
	JoinScope      bool // the session joined its scope (runtime session id known)
	LeaveScope     bool // the session left its scope
	DropHandle     bool // the session's cached handle is no longer valid
	Restarted      bool // another wrapper instance served this route before (retire the scope's handles)
	SendPrepare    bool // send PrepareRoute on the serving wrapper's stream
	SendRelease    bool // send ReleaseRoute on the serving wrapper's stream
	Notify         Notice
	Reason         string // of NoticeLost / NoticeFailed
	Retryable      bool   // of NoticeFailed
	StartPreparing bool   // (re)start preparing the route (the driver's startPreparing)
}

// Event is one input of the transition function.
type Event interface{ isEvent() }

// Prepare: the session service asks for the route in Directory. Restart
// continues a route that failed ReasonResumeStateLost with a new
// conversation.
type Prepare struct {
	Directory string
	Restart   bool
}

// Keyed: preparation chose the route's runtime key under the scope's contract.
type Keyed struct {
	RuntimeKey string
	Contract   scope.Contract
}

// StepReached: preparation reached Step.
type StepReached struct{ Step string }

// PrepareSent: PrepareRoute goes to a wrapper serving Contract (whatever
// state the route reached meanwhile);
// RuntimeSessionID names the runtime session if the route has none yet.
type PrepareSent struct {
	Contract         scope.Contract
	RuntimeSessionID string
}

// WrapperHello: Instance of RuntimeKey authenticated; Kept is whether its
// Hello lists this route as active, under RuntimeSessionID.
type WrapperHello struct {
	RuntimeKey, Instance string
	Kept                 bool
	RuntimeSessionID     string
}

// RouteReady: the wrapper Instance of RuntimeKey opened the route.
type RouteReady struct{ RuntimeKey, Instance, RuntimeSessionID string }

// RouteFailed: the route cannot be prepared. RuntimeKey is the reporting
// wrapper's key ("" when the driver itself fails the route).
type RouteFailed struct {
	RuntimeKey string
	Reason     string
	Retryable  bool
}

// StreamClosed: the stream of RuntimeKey's wrapper ended.
type StreamClosed struct{ RuntimeKey string }

// OwnerResumed: this replica took the sandbox over from a previous owner.
type OwnerResumed struct{}

// KeyStopped: a stop that held preparation back ended (absence verified, or
// the key was re-keyed per session): preparation may continue.
type KeyStopped struct{}

// WrapperStopping: a timer-driven stop of RuntimeKey's wrapper began.
type WrapperStopping struct{ RuntimeKey, Reason string }

// WrapperGone: discovery verified RuntimeKey's disconnected wrapper is gone.
type WrapperGone struct{ RuntimeKey, Reason string }

// Release: the session leaves its route. Credentials: a credential service
// is configured, so the member release is a pending intent.
type Release struct{ Credentials bool }

// MemberReleased: the credential service no longer lists the session.
type MemberReleased struct{}

// Forget: the released route's runtime key is verified absent (or allowed
// gone); the record goes.
type Forget struct{}

// Recreated: a recovery of the route's runtime key removed what of it was
// recreatable (an empty workspace, a home holding nothing but its record):
// nothing a resume needs was there, so its absence is no loss.
type Recreated struct{}

func (Prepare) isEvent()         {}
func (Keyed) isEvent()           {}
func (StepReached) isEvent()     {}
func (PrepareSent) isEvent()     {}
func (WrapperHello) isEvent()    {}
func (RouteReady) isEvent()      {}
func (RouteFailed) isEvent()     {}
func (StreamClosed) isEvent()    {}
func (OwnerResumed) isEvent()    {}
func (KeyStopped) isEvent()      {}
func (WrapperStopping) isEvent() {}
func (WrapperGone) isEvent()     {}
func (Release) isEvent()         {}
func (MemberReleased) isEvent()  {}
func (Forget) isEvent()          {}
func (Recreated) isEvent()       {}

// Apply is the transition function. It is pure: the result depends only on
// its arguments.
func Apply(r Route, ev Event) (Route, Effects) {
	switch e := ev.(type) {
	case Prepare:
		return prepare(r, e)
	case Keyed, StepReached, PrepareSent:
		return preparation(r, ev)
	case WrapperHello:
		return hello(r, e)
	case RouteReady, RouteFailed, StreamClosed, WrapperStopping, WrapperGone:
		return fromWrapper(r, ev)
	}
	return lifecycle(r, ev)
}

// preparation applies the steps of a route being prepared.
func preparation(r Route, ev Event) (Route, Effects) {
	if e, ok := ev.(PrepareSent); ok && r.recorded() {
		// The frame goes out whatever the route reached meanwhile, so it
		// carries the contract and the runtime session id it is minted under.
		if r.State == Preparing {
			r.Step = StepPrepareRoute
		}
		r.Contract = e.Contract
		if r.RuntimeSessionID == "" {
			r.RuntimeSessionID = e.RuntimeSessionID
		}
		return r, Effects{Persist: true}
	}
	if r.State != Preparing {
		return r, Effects{}
	}
	switch e := ev.(type) {
	case Keyed:
		r.RuntimeKey, r.Contract = e.RuntimeKey, e.Contract
	case StepReached:
		r.Step = e.Step
	}
	return r, Effects{Persist: true}
}

// fromWrapper applies what a runtime key's wrapper reported or what
// happened to it; another key's events do not touch the route.
func fromWrapper(r Route, ev Event) (Route, Effects) {
	switch e := ev.(type) {
	case RouteReady:
		if !r.recorded() || r.State == Released || r.RuntimeKey != e.RuntimeKey {
			return r, Effects{}
		}
		r.State, r.Step, r.FailureReason = Ready, "", ""
		r.RuntimeSessionID, r.WrapperInstance = e.RuntimeSessionID, e.Instance
		r.Served, r.Restart = true, false
		return r, Effects{Persist: true, JoinScope: true, Notify: NoticeReady}
	case RouteFailed:
		if !r.recorded() || r.State == Released || (e.RuntimeKey != "" && e.RuntimeKey != r.RuntimeKey) {
			return r, Effects{}
		}
		return fail(r, e.Reason, e.Retryable)
	case StreamClosed:
		if r.State != Ready || r.RuntimeKey != e.RuntimeKey {
			return r, Effects{}
		}
		r.State = Reconnecting
		return r, Effects{Persist: true, Notify: NoticeReconnecting}
	case WrapperStopping:
		if r.RuntimeKey != e.RuntimeKey {
			return r, Effects{}
		}
		if r.State == Preparing {
			return fail(r, e.Reason, true)
		}
		return lost(r, e.Reason)
	case WrapperGone:
		if r.RuntimeKey != e.RuntimeKey {
			return r, Effects{}
		}
		return lost(r, e.Reason)
	}
	return r, Effects{}
}

// lifecycle applies the owner's and the session's events.
func lifecycle(r Route, ev Event) (Route, Effects) {
	switch e := ev.(type) {
	case OwnerResumed:
		switch r.State {
		case Preparing:
			return r, Effects{StartPreparing: true}
		case Ready:
			r.State = Reconnecting
			return r, Effects{Persist: true, Notify: NoticeReconnecting}
		}
	case KeyStopped:
		if r.State == Preparing {
			return r, Effects{StartPreparing: true}
		}
	case Release:
		if !r.recorded() || r.State == Released {
			return r, Effects{}
		}
		r.State, r.Step, r.MemberReleasePending = Released, "", e.Credentials
		return r, Effects{Persist: true, LeaveScope: true, DropHandle: true, SendRelease: true}
	case MemberReleased:
		if r.State == Released && r.MemberReleasePending {
			r.MemberReleasePending = false
			return r, Effects{Persist: true}
		}
	case Forget:
		if r.State == Released {
			return Route{}, Effects{Delete: true}
		}
	case Recreated:
		if r.Served {
			r.Served = false
			return r, Effects{Persist: true}
		}
	}
	return r, Effects{}
}

func prepare(r Route, e Prepare) (Route, Effects) {
	// A released route no longer holds its directory; any other record does.
	if r.recorded() && r.State != Released && r.Directory != e.Directory {
		return r, Effects{Err: ErrDirectoryMoved}
	}
	switch r.State {
	case Preparing:
		return r, Effects{StartPreparing: true}
	case Ready, Reconnecting:
		return r, Effects{}
	}
	next := Route{State: Preparing, Directory: e.Directory, Step: StepAllocate}
	if r.State == Unknown || r.State == Failed {
		// A route prepared again (after a suspend, an idle stop or a lost
		// wrapper) keeps its runtime session: the agent session/loads the
		// same conversation, and one history holds all of it.
		next.RuntimeSessionID, next.Served, next.Restart = r.RuntimeSessionID, r.Served, r.Restart
		if e.Restart && r.State == Failed && r.FailureReason == ReasonResumeStateLost {
			// The old conversation is gone: a new one, under a new runtime
			// session, from a fresh home.
			next.RuntimeSessionID, next.Served, next.Restart = "", false, true
		}
	}
	return next, Effects{Admit: true, Persist: true, StartPreparing: true}
}

func hello(r Route, e WrapperHello) (Route, Effects) {
	if r.RuntimeKey != e.RuntimeKey {
		return r, Effects{}
	}
	if e.Kept && r.WrapperInstance == e.Instance && (r.State == Reconnecting || r.State == Ready) {
		r.State, r.RuntimeSessionID = Ready, e.RuntimeSessionID
		return r, Effects{Persist: true, Notify: NoticeReady}
	}
	if r.State != Preparing && r.State != Reconnecting {
		return r, Effects{}
	}
	restarted := r.WrapperInstance != "" && r.WrapperInstance != e.Instance
	r.State, r.Step = Preparing, StepPrepareRoute
	return r, Effects{Persist: true, SendPrepare: true, Restarted: restarted, DropHandle: restarted}
}

func fail(r Route, reason string, retryable bool) (Route, Effects) {
	r.State, r.FailureReason, r.Retryable, r.Step = Failed, reason, retryable, ""
	return r, Effects{Persist: true, Notify: NoticeFailed, Reason: reason, Retryable: retryable}
}

func lost(r Route, reason string) (Route, Effects) {
	if r.State != Ready && r.State != Reconnecting {
		return r, Effects{}
	}
	r.State, r.Step = Unknown, ""
	return r, Effects{Persist: true, Notify: NoticeLost, Reason: reason}
}

func (r Route) recorded() bool { return r.State != Absent }

// Live reports a route that is being prepared or served: Prepare returns it
// as it is (routes.go Prepare).
func (r Route) Live() bool {
	return r.State == Preparing || r.State == Ready || r.State == Reconnecting
}

// Deliverable reports whether messages and worktree calls may go to the
// route's wrapper (routes.go Deliver, worktree.go worktreeCall).
func (r Route) Deliverable() bool { return r.State == Ready }

// Member reports whether the route still counts as a member of its runtime
// key: the last member's release stops the key (routes.go ReleaseRoute,
// releaseUnrouted).
func (r Route) Member() bool { return r.recorded() && r.State != Released && r.State != Failed }
