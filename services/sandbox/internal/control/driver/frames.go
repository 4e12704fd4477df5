package driver

import (
	"time"

	"agentplane.dev/pkg/gitrepo"

	"agentplane.dev/services/sandbox/internal/control/scope"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// The frames of a wrapper's control stream, as the driver speaks them.
// internal/edge/wrapperconn alone converts them to and from the wire
// (WrapperControlService.Connect); the driver never sees a proto.

// FromWrapper is a frame a wrapper sent: Hello, Heartbeat, Progress,
// RouteReady, RouteFailed, RuntimeEvents, Outcome or WorktreeResult.
type FromWrapper interface{ fromWrapper() }

// ToWrapper is a frame the driver sends a wrapper: HelloAck, PrepareRoute,
// Delivery, Abort, HandleUpdate, Shutdown, ReleaseRoute or WorktreeRequest.
type ToWrapper interface{ toWrapper() }

// Hello is a wrapper's first frame: who it is, what it can serve and the
// routes its runtime still holds (after a reconnect).
type Hello struct {
	SandboxID, AllocationID, RuntimeKey, InstanceID string
	Generation, FenceToken                          uint64
	LaunchCredential                                string
	Capabilities                                    []string
	ProtocolVersion                                 uint32
	Routes                                          []ActiveRoute
}

// ActiveRoute is a route a reconnecting wrapper's runtime still serves.
type ActiveRoute struct{ SessionID, RuntimeSessionID string }

// Heartbeat keeps the wrapper's allocation alive; busy sessions count as
// activity.
type Heartbeat struct{ BusySessionIDs []string }

// Progress is a preparation step the wrapper reached for a route.
type Progress struct {
	SessionID string
	Step      ProgressStep
}

// RouteReady: the route's runtime session runs.
type RouteReady struct{ SessionID, RuntimeSessionID string }

// RouteFailed: the wrapper could not prepare the route.
type RouteFailed struct {
	SessionID, Reason string
	Retryable         bool
}

// RuntimeEvents are a route's runtime events, relayed to the session service.
type RuntimeEvents struct {
	SessionID string
	Events    []RuntimeEvent
}

// Outcome is a route's turn outcome, relayed to the session service.
type Outcome struct {
	SessionID string
	Outcome   TurnOutcome
}

// WorktreeResult answers a WorktreeRequest: Changes for a changes action,
// the commit for a push, or the wrapper's UPPER_SNAKE error reason.
type WorktreeResult struct {
	RequestID                string
	Changes                  *gitrepo.Changes // nil: none sent
	CommitID, Ref            string
	Committed                bool
	ErrorReason, ErrorDetail string
	Files                    []WorktreeFile // list action
	FilesMore                bool
	Data                     []byte // read action
	FileSize                 int64
	FilesWritten             int // write action
	BytesWritten             int64
}

// WorktreeFile is one entry of a worktree directory (not followed).
type WorktreeFile struct {
	Name string
	Type FileType
	Size int64
	Mode uint32 // permission bits
}

// FileType is what a worktree entry is.
type FileType string

// File types.
const (
	FileRegular   FileType = "file"
	FileDirectory FileType = "directory"
	FileSymlink   FileType = "symlink"
	FileOther     FileType = "other"
)

func (Hello) fromWrapper()          {}
func (Heartbeat) fromWrapper()      {}
func (Progress) fromWrapper()       {}
func (RouteReady) fromWrapper()     {}
func (RouteFailed) fromWrapper()    {}
func (RuntimeEvents) fromWrapper()  {}
func (Outcome) fromWrapper()        {}
func (WorktreeResult) fromWrapper() {}

// HelloAck accepts a Hello with the timers and the negotiated contract.
type HelloAck struct {
	Heartbeat, ReconnectWindow time.Duration
	Contract                   scope.Contract
}

// PrepareRoute asks the wrapper to open a route on its runtime.
type PrepareRoute struct {
	SessionID, Directory, RepoURL, Handle, ProxyURL string
	Contract                                        scope.Contract
	RuntimeSessionID                                string
	Agent                                           store.Agent
	RepoRef                                         string
	RepoDepth                                       uint32
	CloneRepo                                       bool
	Traceparent                                     string
}

// Delivery writes messages to a ready route.
type Delivery struct {
	SessionID   string
	Messages    []Message
	Traceparent string
}

// Abort asks the runtime to stop a message's turn (best effort).
type Abort struct{ SessionID, MessageID string }

// HandleUpdate gives routes of the wrapper a new credential handle (a
// rotation, or a fresh canonical handle after a retirement).
type HandleUpdate struct {
	SessionIDs []string
	Handle     string
}

// ShutdownReason says why the driver ends a wrapper's stream.
type ShutdownReason string

// Shutdown reasons.
const (
	StaleAllocation ShutdownReason = "stale_allocation"
	StaleFence      ShutdownReason = "stale_fence"
	BadCredential   ShutdownReason = "bad_credential"
	LeaseLost       ShutdownReason = "lease_lost"
	StopRequested   ShutdownReason = "stop_requested"
)

// Shutdown tells the wrapper to exit; the stream ends after it.
type Shutdown struct {
	Reason ShutdownReason
	Detail string
}

// ReleaseRoute removes a route from the wrapper's runtime.
type ReleaseRoute struct{ SessionID string }

// WorktreeRequest asks the wrapper for its worktree's changes, or (Push
// set) to commit and push them.
type WorktreeRequest struct {
	RequestID, SessionID string
	// At most one action; none is the change set.
	Push  *WorktreePush
	List  *WorktreeList
	Read  *WorktreeRead
	Write []WorktreeWrite
}

// WorktreeWrite is one file of a WorktreeRequest's write action; Mode 0
// keeps an existing file's permission bits.
type WorktreeWrite struct {
	Path string
	Data []byte
	Mode uint32
}

// WorktreeList is a WorktreeRequest's list action: up to Limit entries of
// the directory Path sorted after the name After.
type WorktreeList struct {
	Path, After string
	Limit       int
}

// WorktreeRead is a WorktreeRequest's read action: up to Length bytes of
// the file Path from Offset.
type WorktreeRead struct {
	Path   string
	Offset int64
	Length int
}

// WorktreePush is a WorktreeRequest's push action; an empty author is the
// agentplane identity.
type WorktreePush struct{ Branch, CommitMessage, AuthorName, AuthorEmail string }

func (HelloAck) toWrapper()        {}
func (PrepareRoute) toWrapper()    {}
func (Delivery) toWrapper()        {}
func (Abort) toWrapper()           {}
func (HandleUpdate) toWrapper()    {}
func (Shutdown) toWrapper()        {}
func (ReleaseRoute) toWrapper()    {}
func (WorktreeRequest) toWrapper() {}

// stopRequested is the Shutdown of a stop the driver asked for.
func stopRequested(reason string) Shutdown { return Shutdown{Reason: StopRequested, Detail: reason} }
