package reconciler

import (
	"context"
	"errors"
	"time"

	"agentplane.dev/services/sandbox/internal/lease"
)

var errTODO = errors.New("reconciler: not implemented yet")

// Reconciler drives wrapper leases. Build it with New.
type Reconciler struct{ cfg Config }

// New builds a Reconciler.
func New(cfg Config) *Reconciler { return &Reconciler{cfg: cfg} }

// Adopt starts reconciling sandboxID under fence f and runs a leak sweep.
func (r *Reconciler) Adopt(ctx context.Context, sandboxID string, f Fence) error { return errTODO }

// Forget stops reconciling sandboxID (its owner lease was lost).
func (r *Reconciler) Forget(sandboxID string) {}

// EnsureWrapper applies the launch-or-reuse rule.
func (r *Reconciler) EnsureWrapper(ctx context.Context, sandboxID, runtimeKey string, launch LaunchFunc) (Decision, error) {
	return Decision{}, errTODO
}

// StartupVerified records that the wrapper of instance said Hello and its
// workspace is ready.
func (r *Reconciler) StartupVerified(ctx context.Context, sandboxID, runtimeKey, instance string) error {
	return errTODO
}

// DeliveryAccepted records work delivered to the wrapper of instance.
func (r *Reconciler) DeliveryAccepted(ctx context.Context, sandboxID, runtimeKey, instance string) error {
	return errTODO
}

// Reuse records that the wrapper of instance serves another route.
func (r *Reconciler) Reuse(ctx context.Context, sandboxID, runtimeKey, instance string) error {
	return errTODO
}

// RetainWarm keeps the wrapper of instance until until.
func (r *Reconciler) RetainWarm(ctx context.Context, sandboxID, runtimeKey, instance string, until time.Time) error {
	return errTODO
}

// WrapperGone releases the lease of instance on verified absence, else
// requests a stop.
func (r *Reconciler) WrapperGone(ctx context.Context, sandboxID, runtimeKey, instance string) error {
	return errTODO
}

// RequestStop requests a stop of every wrapper of the runtime key.
func (r *Reconciler) RequestStop(ctx context.Context, sandboxID, runtimeKey, reason string) error {
	return errTODO
}

// AbsenceVerified reports whether no wrapper of the key can run.
func (r *Reconciler) AbsenceVerified(ctx context.Context, sandboxID, runtimeKey string) (bool, time.Duration, error) {
	return false, 0, errTODO
}

// Lease reads the lease of a runtime key.
func (r *Reconciler) Lease(ctx context.Context, sandboxID, runtimeKey string) (lease.Lease, error) {
	return lease.Lease{}, errTODO
}

// Sweep runs the leak sweep of one adopted sandbox.
func (r *Reconciler) Sweep(ctx context.Context, sandboxID string) error { return errTODO }

// Tick runs one pass over every adopted sandbox's leases.
func (r *Reconciler) Tick(ctx context.Context) error { return errTODO }

// Run ticks and sweeps until ctx ends.
func (r *Reconciler) Run(ctx context.Context) error { <-ctx.Done(); return nil }
