// Package capacity is cold-workspace capacity admission (DESIGN.md 3.4).
//
// A warm workspace (already prepared) is admitted without a check. A cold
// one measures the free bytes of the sandbox filesystem once; at or above
// the threshold it is admitted and nothing is cleaned. Below it, a
// conservative stale cleanup runs and the free bytes are measured again;
// still low → provider.CapacityRejectedError (CAPACITY_REJECTED, retryable,
// the sandbox is kept). Cleanup removes only workspace/home directories that
// no stored route names (the current one's, a suspended or idle-stopped
// session's), are older than StaleAge by mtime, and have no live wrapper; a directory of unknown age is skipped, and a failed process
// listing skips everything. Unmeasurable capacity returns
// provider.ErrCapacityUnmeasurable and removes nothing; only
// provider.StartsRecovery errors (ENOSPC evidence, failed setup) lead to
// the recovery of the route's runtime key (the driver's recovery.go), which
// never destroys a sandbox.
package capacity

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Disk is what admission needs from a provider (the process provider
// implements it).
type Disk interface {
	Capacity(ctx context.Context, sandboxID string) provider.Capacity
	// Workspaces lists workspace directories with their ages.
	Workspaces(ctx context.Context, sandboxID string) ([]provider.WorkspaceDir, error)
	// LiveWorkspaces names the workspaces served by a live process; an
	// error means the process listing failed.
	LiveWorkspaces(ctx context.Context, sandboxID string) (map[string]bool, error)
	RemoveWorkspace(ctx context.Context, sandboxID, name string) error
}

// Config of admission. Zero values take the DESIGN.md defaults.
type Config struct {
	ThresholdBytes uint64        // default 2 GiB
	StaleAge       time.Duration // default 20 min
	// Reserved is the disk the other live sandboxes of the node may still
	// write within their quotas (nil: none): admission counts it as used,
	// so one sandbox filling its quota never takes another's admission.
	Reserved func(exceptSandboxID string) uint64
	Now      func() time.Time
	Logger   *slog.Logger
}

// Defaults of DESIGN.md 3.4.
const (
	DefaultThreshold = 2 << 30 // 2 GiB
	DefaultStaleAge  = 20 * time.Minute
)

// Admission admits cold workspaces.
type Admission struct {
	disk Disk
	cfg  Config
}

// New builds an Admission.
func New(disk Disk, cfg Config) *Admission {
	if cfg.ThresholdBytes == 0 {
		cfg.ThresholdBytes = DefaultThreshold
	}
	if cfg.StaleAge == 0 {
		cfg.StaleAge = DefaultStaleAge
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Admission{disk: disk, cfg: cfg}
}

// Report says what admission did.
type Report struct {
	Measurements   int // 0 for a warm workspace
	AvailableBytes uint64
	Cleaned        int
	Skipped        int
}

// Admit admits a workspace of the sandbox. current is the provider's name
// of the route's workspace and kept those of the sandbox's other stored
// routes (workspaces and homes): never cleaned; warm skips the check.
func (a *Admission) Admit(ctx context.Context, sandboxID, current string, warm bool, kept ...string) (Report, error) {
	var rep Report
	if warm {
		return rep, nil
	}
	avail, err := a.measure(ctx, sandboxID, &rep)
	if err != nil || avail >= a.cfg.ThresholdBytes {
		return rep, err
	}
	rep.Cleaned, rep.Skipped = a.cleanup(ctx, sandboxID, append(kept, current))
	if avail, err = a.measure(ctx, sandboxID, &rep); err != nil {
		return rep, err
	}
	if avail >= a.cfg.ThresholdBytes {
		return rep, nil
	}
	return rep, &provider.CapacityRejectedError{
		AvailableBytes: avail, ThresholdBytes: a.cfg.ThresholdBytes,
		Cleaned: rep.Cleaned, Skipped: rep.Skipped,
	}
}

func (a *Admission) measure(ctx context.Context, sandboxID string, rep *Report) (uint64, error) {
	rep.Measurements++
	c := a.disk.Capacity(ctx, sandboxID)
	switch c.Kind {
	case provider.CapacityMeasured:
		avail := c.AvailableBytes
		if a.cfg.Reserved != nil {
			avail -= min(avail, a.cfg.Reserved(sandboxID))
		}
		rep.AvailableBytes = avail
		return avail, nil
	case provider.CapacityENOSPC:
		return 0, fmt.Errorf("%w: %w", provider.ErrENOSPC, c.Err)
	default:
		return 0, fmt.Errorf("%w: %w", provider.ErrCapacityUnmeasurable, c.Err)
	}
}

// cleanup removes stale directories and counts what it removed and kept.
func (a *Admission) cleanup(ctx context.Context, sandboxID string, kept []string) (cleaned, skipped int) {
	dirs, err := a.disk.Workspaces(ctx, sandboxID)
	if err != nil {
		a.cfg.Logger.Warn("capacity cleanup: cannot list workspaces", "sandbox", sandboxID, "err", err)
		return 0, 0
	}
	live, err := a.disk.LiveWorkspaces(ctx, sandboxID)
	if err != nil {
		a.cfg.Logger.Warn("capacity cleanup: process listing failed, cleaning nothing", "sandbox", sandboxID, "err", err)
		return 0, len(dirs)
	}
	for _, name := range kept {
		live[name] = true // a stored route's work, whether or not a process serves it
	}
	now := a.cfg.Now()
	for _, d := range dirs {
		if !a.stale(d, live, now) {
			skipped++
			continue
		}
		if err := a.disk.RemoveWorkspace(ctx, sandboxID, d.Name); err != nil {
			a.cfg.Logger.Warn("capacity cleanup: remove failed", "sandbox", sandboxID, "workspace", d.Name, "err", err)
			skipped++
			continue
		}
		cleaned++
	}
	a.cfg.Logger.Info("capacity cleanup", "sandbox", sandboxID, "cleaned", cleaned, "skipped", skipped)
	return cleaned, skipped
}

func (a *Admission) stale(d provider.WorkspaceDir, kept map[string]bool, now time.Time) bool {
	switch {
	case kept[d.Name]:
		return false
	case d.ModTimeErr != nil, d.ModTime.IsZero(), d.ModTime.After(now):
		return false // unknown age (unreadable, or from the future)
	}
	return now.Sub(d.ModTime) > a.cfg.StaleAge
}
