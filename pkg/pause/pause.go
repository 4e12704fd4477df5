// Package pause waits for a duration unless a context ends first. Services
// use Sleep as the default of their injectable wait functions, so tests can
// swap in a fake clock.
package pause

import (
	"context"
	"time"
)

// Sleep waits for d, or returns ctx's error as soon as ctx ends. A d of zero
// or less returns at once (with ctx's error if it has already ended).
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
