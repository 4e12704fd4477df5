package server

import (
	"context"
	"fmt"
	"log/slog"
	"syscall"
	"time"

	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/network/socketrelay"
	"agentplane.dev/services/sandbox/internal/node/provider"
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

// plannedSandboxes is how many active sandboxes one node's service is
// sized for (DESIGN.md 3.3: 50 on a 2-core 24 GiB node).
const plannedSandboxes = 50

// handedSockets is how many sockets each sandbox holds connections to:
// control, credential proxy relay, egress, OTLP relay.
const handedSockets = 4

// fdBudget says why perPeer connections on each handed-in socket for every
// planned sandbox would not fit this process's open-file limit, or "".
func fdBudget(perPeer int) string {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil || perPeer <= 0 {
		return ""
	}
	// Each relayed connection holds two descriptors (the sandbox's end and
	// the one it is joined to).
	need := uint64(plannedSandboxes * handedSockets * perPeer * 2)
	if need > r.Cur/2 {
		return fmt.Sprintf("%d sandboxes × %d sockets × %d connections × 2 = %d descriptors, over half of RLIMIT_NOFILE %d",
			plannedSandboxes, handedSockets, perPeer, need, r.Cur)
	}
	return ""
}

// socketBounds bound each sandbox's connections to every socket handed in.
func (c *Config) socketBounds() socketrelay.Bounds {
	return socketrelay.Bounds{PerPeer: c.SocketConns, Idle: c.SocketIdle}
}
