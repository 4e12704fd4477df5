// Package provider is the AgentSandbox seam (DESIGN.md 3.3): the only code of
// the sandbox service that touches physical sandboxes, processes and disk.
//
// Every inspection answers with a typed result in which "could not look"
// (InspectionFailed) is distinct from "looked and found nothing" (Absent):
// callers must never read an inspection failure as absence.
package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"
)

// Marker environment variables set on every wrapper at launch. Discovery
// matches them exactly (never by substring).
const (
	EnvSandbox    = "AGENTPLANE_SANDBOX"
	EnvRuntimeKey = "AGENTPLANE_RUNTIME_KEY"
	EnvInstance   = "AGENTPLANE_INSTANCE"
	EnvGeneration = "AGENTPLANE_GENERATION"
	// EnvDeployment and EnvSandboxRoot scope discovery to one deployment:
	// two deployments on one host (same org and user, so the same sandbox
	// ids) never see, let alone stop, each other's wrappers.
	EnvDeployment  = "AGENTPLANE_DEPLOYMENT"
	EnvSandboxRoot = "AGENTPLANE_SANDBOX_ROOT"
)

// Markers identify one wrapper process.
type Markers struct {
	SandboxID  string
	RuntimeKey string
	InstanceID string
	Generation uint64
}

// LaunchSpec describes a wrapper to start inside a sandbox.
type LaunchSpec struct {
	Markers Markers
	// Identity, when set, is handed to the wrapper as --allocation,
	// --fence-token and --credential-fd (a pipe after ExtraFiles), or, to
	// a pooled wrapper that takes the launch, in its Claim.
	Identity *Identity
	// Path and Args of the wrapper command (Args excludes the program name
	// and the Identity flags: what every wrapper of the same shape shares).
	Path string
	Args []string
	// Env is extra environment (never secrets: environ is readable through /proc).
	Env []string
	// ExtraFiles are inherited by the child as fds 3, 4, ... (the launch
	// credential travels this way so it never appears in environ or cmdline).
	ExtraFiles []*os.File
	// Workspace is the worktree directory the wrapper serves (as named by the
	// route); the provider maps it under the sandbox's workspaces/ tree.
	Workspace string
}

// Observed is one wrapper process seen by discovery.
type Observed struct {
	PID        int
	InstanceID string // empty when Unmarked
	Generation uint64
	// Unmarked wrappers carry the sandbox and runtime key markers but no
	// instance marker; they force a stop of their runtime key.
	Unmarked bool
	// Workspace is the provider's name of the workspace the wrapper serves
	// ("" when unknown).
	Workspace string
}

// DiscoverKind is the outcome of Discover.
type DiscoverKind int

const (
	Absent           DiscoverKind = iota + 1 // looked, found no wrapper of the key
	Present                                  // found wrappers (see Observed)
	InspectionFailed                         // could not look; never read as absence
)

// Discovery is the result of Discover.
type Discovery struct {
	Kind     DiscoverKind
	Observed []Observed
	Err      error // set when Kind is InspectionFailed
}

// StopKind is the outcome of Stop.
type StopKind int

const (
	StopAbsent           StopKind = iota + 1 // verified gone
	StopStillPresent                         // still running after the kill sequence
	StopInspectionFailed                     // could not verify; never read as absence
)

// StopResult is the result of Stop.
type StopResult struct {
	Kind StopKind
	Err  error
}

// StopTarget selects what Stop stops: every wrapper of the runtime key, or
// only one instance.
type StopTarget struct {
	SandboxID  string
	RuntimeKey string
	InstanceID string // empty: every wrapper of the runtime key, marked or not
}

// CapacityKind is the outcome of Capacity.
type CapacityKind int

const (
	CapacityMeasured     CapacityKind = iota + 1 // AvailableBytes is set
	CapacityUnmeasurable                         // could not measure; never destroys the sandbox
	CapacityENOSPC                               // explicit ENOSPC evidence
)

// Capacity is the result of Capacity.
type Capacity struct {
	Kind           CapacityKind
	AvailableBytes uint64
	Err            error
}

// DeleteReason says why a sandbox (or part of it) is deleted.
type DeleteReason int

const (
	// DeleteWorkspace removes one workspace and its home on a shared sandbox.
	DeleteWorkspace DeleteReason = iota + 1
	// DeleteHome removes a runtime key's home (the workspace argument names
	// the key) once its wrapper is verified absent.
	DeleteHome
	// DeleteReleased removes the whole tree of a sandbox with no session
	// left and no process of it running, when the owner lets it go: nothing
	// of it outlives its sessions, its tenant binding included (issue 32).
	DeleteReleased
)

// AgentSandbox is the provider seam. Implementations: process (this node's
// directories and child processes); kubernetes (a pod per sandbox) is planned.
type AgentSandbox interface {
	// Create prepares the sandbox (idempotent).
	Create(ctx context.Context, sandboxID string) error
	// Launch starts a wrapper with its markers in its own process group.
	Launch(ctx context.Context, spec LaunchSpec) (Observed, error)
	// Discover finds the wrappers of a runtime key.
	Discover(ctx context.Context, sandboxID, runtimeKey string) Discovery
	// Stop stops the target's wrappers and verifies their absence.
	Stop(ctx context.Context, target StopTarget) StopResult
	// KeepAlive extends the sandbox's life (no-op for process).
	KeepAlive(ctx context.Context, sandboxID string) error
	// Capacity measures free bytes of the sandbox filesystem.
	Capacity(ctx context.Context, sandboxID string) Capacity
	// Delete removes a workspace (and its home), a runtime key's home or the
	// whole sandbox.
	Delete(ctx context.Context, sandboxID, workspace string, reason DeleteReason) error
}

// RootMeter is implemented by providers whose sandboxes share one
// filesystem (process: the sandbox root): RootCapacity measures its free
// bytes, the node's room rather than one sandbox's (Capacity).
type RootMeter interface {
	RootCapacity() Capacity
}

// StateKeeper is implemented by providers whose workspaces and runtime
// homes outlive a stopped runtime (process: directories on this node). A
// resumed route checks them before its runtime is launched again.
type StateKeeper interface {
	// StateKept reports whether the workspace and the runtime key's home
	// both still exist; an error is an inspection failure, never loss.
	StateKept(ctx context.Context, sandboxID, workspace, runtimeKey string) (bool, error)
}

// Inventory is implemented by providers that can list every wrapper of a
// sandbox, whatever its runtime key; the reconciler's leak sweep uses it to
// find wrappers of keys that have no lease at all.
type Inventory interface {
	DiscoverSandbox(ctx context.Context, sandboxID string) SandboxDiscovery
}

// SandboxDiscovery is the result of DiscoverSandbox: the sandbox's wrappers
// grouped by runtime key ("" for wrappers without a runtime key marker).
type SandboxDiscovery struct {
	Kind         DiscoverKind
	ByRuntimeKey map[string][]Observed
	Err          error
}

// WorkspaceDir is one workspace (with its home) of a sandbox, as capacity
// cleanup sees it.
type WorkspaceDir struct {
	Name       string    // provider's name of the workspace
	ModTime    time.Time // newest mtime of its directories
	ModTimeErr error     // set when the age cannot be read
}

// Typed errors. errors.Is works on wrapped errors.
var (
	ErrCapacityRejected     = errors.New("provider: capacity rejected")
	ErrCapacityUnmeasurable = errors.New("provider: capacity unmeasurable")
	ErrENOSPC               = errors.New("provider: no space left on device")
	ErrFilesystemSetup      = errors.New("provider: filesystem preparation failed")
	// ErrDiskQuota: the sandbox's workspaces and homes use its whole disk
	// quota; its routes fail with disk_quota, other sandboxes are not touched.
	ErrDiskQuota = errors.New("provider: disk quota exceeded")
	// ErrDirectoryReserved: the route's directory is where the sandbox
	// binds the workspace, and it cannot be there (a system path, the
	// sandbox's HOME or another path it binds itself); nothing was
	// launched, and the route fails with ReasonDirectoryReserved.
	ErrDirectoryReserved = errors.New("provider: directory reserved")
)

// CapacityRejectedError is CAPACITY_REJECTED: free space stayed below the
// threshold after conservative cleanup. Retryable; the sandbox is kept.
type CapacityRejectedError struct {
	AvailableBytes uint64
	ThresholdBytes uint64
	Cleaned        int // directories removed by stale cleanup
	Skipped        int // directories cleanup kept (current, young, unknown age, live wrapper, listing failed)
}

func (e *CapacityRejectedError) Error() string {
	return fmt.Sprintf("provider: capacity rejected: %d bytes free, need %d (cleaned %d, skipped %d)",
		e.AvailableBytes, e.ThresholdBytes, e.Cleaned, e.Skipped)
}

// Is makes errors.Is(err, ErrCapacityRejected) true.
func (e *CapacityRejectedError) Is(target error) bool { return target == ErrCapacityRejected }

// IsENOSPCEvidence reports explicit ENOSPC evidence: the errno in err's
// chain, or "no space left on device" in err's text or in output (a
// command's stderr).
func IsENOSPCEvidence(err error, output string) bool {
	if err != nil && (errors.Is(err, syscall.ENOSPC) || errors.Is(err, ErrENOSPC) || containsENOSPC(err.Error())) {
		return true
	}
	return containsENOSPC(output)
}

func containsENOSPC(s string) bool {
	return strings.Contains(strings.ToLower(s), "no space left on device")
}

// SetupError classifies a failure of directory setup (op names the step):
// ENOSPC evidence wraps ErrENOSPC, anything else ErrFilesystemSetup. Both
// start the recovery of the route's runtime key (see StartsRecovery).
func SetupError(op string, err error) error {
	if IsENOSPCEvidence(err, "") {
		return fmt.Errorf("%w: %s: %w", ErrENOSPC, op, err)
	}
	return fmt.Errorf("%w: %s: %w", ErrFilesystemSetup, op, err)
}

// StartsRecovery is the one table of which errors start the recovery of
// the failed route's runtime key (DESIGN.md 3.4 as amended by issue 33):
//
//	error                              recovery of the route's runtime key
//	ErrENOSPC (errno or message)       yes: the disk (bytes or inodes) is full
//	ErrFilesystemSetup                 yes: its directories could not be made
//	ErrCapacityRejected                no: retryable, nothing removed
//	ErrCapacityUnmeasurable            no: could not measure is not evidence
//	inspection failures, anything else no
//
// Recovery stops that key's wrappers and, once they are verified absent,
// removes only what of that key is verifiably recreatable (KeyRecoverer);
// it never destroys a sandbox, and never another key's data.
func StartsRecovery(err error) bool {
	return err != nil && (IsENOSPCEvidence(err, "") || errors.Is(err, ErrFilesystemSetup))
}

// KeyRecovery says what the recovery of one runtime key removed and kept.
type KeyRecovery struct {
	// Removed names what went ("home", "workspace"): empty directories and
	// records the next preparation writes again.
	Removed []string
	// KeptWorkspace is set when the key's workspace holds anything: it may
	// hold changes not pushed or exported, so it stays (and is reported).
	KeptWorkspace bool
	// KeptHome is set when the key's home holds more than its record.
	KeptHome bool
}

// KeyRecoverer is implemented by providers that can recover one runtime
// key's data: remove its home and workspace only where they are verifiably
// recreatable (nothing in them but what preparation writes). shared says
// that another runtime key of the sandbox uses the workspace (its
// directory): it is then never touched. The caller verifies first that no
// wrapper of the key runs.
type KeyRecoverer interface {
	RecoverKey(ctx context.Context, sandboxID, runtimeKey, workspace string, shared bool) (KeyRecovery, error)
}

// Limit reasons: a runtime key stopped for a limit of its sandbox
// (DESIGN.md 3.3 "Limits per sandbox"); its routes are lost, and a turn in
// flight fails, with the reason.
const (
	ReasonMemoryLimit = "memory_limit" // the kernel's OOM killer acted in the sandbox's cgroup
	ReasonDiskQuota   = "disk_quota"   // the sandbox's workspace and home passed its disk quota
	// ReasonDirectoryReserved fails a route whose directory its sandbox
	// cannot bind the workspace at (ErrDirectoryReserved).
	ReasonDirectoryReserved = "directory_reserved"
)

// Breach is a runtime key over one of its limits.
type Breach struct {
	SandboxID, RuntimeKey, Reason string
}

// Limiter is implemented by providers that enforce limits per sandbox;
// OverLimit lists the keys that passed one since the last call.
type Limiter interface {
	OverLimit() []Breach
}
