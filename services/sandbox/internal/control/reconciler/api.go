package reconciler

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Errors of the reconciler. errors.Is works on wrapped errors.
var (
	// ErrRefused: launch or reuse is refused (a stop is pending, or
	// discovery found something other than the lease's one wrapper).
	// Delivery must be held; retry after Decision.RetryAfter.
	ErrRefused = errors.New("reconciler: wrapper refused")
	// ErrInspectionFailed: the provider could not look; nothing changed.
	ErrInspectionFailed = errors.New("reconciler: inspection failed")
	// ErrNotAdopted: this reconciler holds no fence for the sandbox.
	ErrNotAdopted = errors.New("reconciler: sandbox not adopted")
)

// Fence is the sandbox's owner (ownership.Owner): leases are written only
// under its fencing token (pkg/fence). Resource is the fence resource of the
// owner lease. The reconciler reads both from the owner at each write and
// keeps no copy of the token.
type Fence interface {
	Resource() string
	Token() uint64
}

// Config of a Reconciler. Zero values take defaults.
type Config struct {
	Redis    redis.UniversalClient
	Provider provider.AgentSandbox
	Policy   lease.Policy     // default lease.DefaultPolicy()
	Now      func() time.Time // default time.Now
	Logger   *slog.Logger
	// TickEvery and SweepEvery pace Run (defaults 1 s and 1 min).
	TickEvery  time.Duration
	SweepEvery time.Duration
	// BeforeStop, if set, runs after a stopping claim is persisted and
	// before provider.Stop (fault tests kill the reconciler here).
	BeforeStop func(ctx context.Context, sandboxID, runtimeKey string, attempt uint64)
	// Stopped, if set, is told when a stop attempt leaves a runtime key's
	// lease free (none), so callers refused meanwhile can try again at once
	// instead of waiting out RetryAfter. It must not block.
	Stopped func(sandboxID, runtimeKey string)
	// Metrics, if set, observe lease changes, stop attempts and leaks.
	Metrics *Metrics
}

// Action says what EnsureWrapper did.
type Action int

const (
	Refused  Action = iota // see ErrRefused
	Launched               // a new wrapper was launched under a new generation
	Reused                 // the lease's one running wrapper was reused
)

// Decision is the result of EnsureWrapper.
type Decision struct {
	Action     Action
	Markers    provider.Markers // of the launched or reused wrapper
	RetryAfter time.Duration    // when Refused
	Reason     string           // why Refused
}

// LaunchFunc starts the wrapper with exactly these markers.
type LaunchFunc func(ctx context.Context, m provider.Markers) error
