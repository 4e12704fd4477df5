package server

import (
	"context"
	"log/slog"
	"time"

	"agentplane.dev/services/sandbox/internal/driver"
	"agentplane.dev/services/sandbox/internal/provider"
)

// limitsEvery is how often the limits of every sandbox are checked.
const limitsEvery = time.Second

// enforceLimits stops each runtime key that passed a limit of its sandbox
// (an OOM kill in its cgroup, its disk quota): its routes are lost with the
// limit's reason, which the session records on the turn in flight.
func enforceLimits(ctx context.Context, prov provider.Limiter, drv *driver.Driver, log *slog.Logger) {
	t := time.NewTicker(limitsEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, b := range prov.OverLimit() {
			log.Warn("sandbox over its limit: stopping its runtime key", "sandbox", b.SandboxID, "runtime_key", b.RuntimeKey, "reason", b.Reason)
			drv.StopOverLimit(ctx, b.SandboxID, b.RuntimeKey, b.Reason)
		}
	}
}
