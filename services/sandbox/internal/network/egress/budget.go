package egress

import (
	"sync"
	"time"
)

// budget is one sandbox's bounds across all its egress connections: how
// many are open, and the bytes they carried (both ways, together) in the
// current window. A window starts with the sandbox's first connection, or
// first byte, after the previous window ended, at zero bytes. Copies
// reserve what they may take next, so concurrent connections cross the
// allowance by at most one byte each.
type budget struct {
	max    int64         // bytes per window; 0: unbounded
	window time.Duration // its length; 0: one window for the proxy's life
	now    func() time.Time
	key    string // the sandbox, for the Ledger
	owner  uint64 // the ownership it counts under (Grant.Owner)

	mu    sync.Mutex
	open  int
	start time.Time
	used  int64
	last  Window // what the Ledger holds, as far as this process knows
}

// resume goes on from a saved window (it rolls over as any, when over).
func (b *budget) resume(w Window) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.start, b.used, b.last = w.Start, w.Used, w
}

// unsaved is the window when it changed since the last save, and when it
// ends (nothing to save for an unbounded budget).
func (b *budget) unsaved() (w Window, ends time.Time, changed bool) {
	if b.max <= 0 {
		return Window{}, time.Time{}, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	w = Window{Start: b.start, Used: b.used}
	ends = b.start.Add(b.window)
	if b.window <= 0 {
		ends = b.now().Add(24 * time.Hour) // one window for the proxy's life: kept a day past the last save
	}
	return w, ends, !b.start.IsZero() && w != b.last
}

func (b *budget) markSaved(w Window) {
	b.mu.Lock()
	b.last = w
	b.mu.Unlock()
}

// rollLocked starts a new window when the current one ended.
func (b *budget) rollLocked() {
	if now := b.now(); b.window > 0 && now.Sub(b.start) >= b.window || b.start.IsZero() {
		b.start, b.used = now, 0
	}
}

// reserve is how many of n bytes a copy may take next, charged now: at
// most one past the allowance, so a connection that would carry more
// crosses it, and is cut, without the rest passing first.
func (b *budget) reserve(n int) int {
	if b.max <= 0 {
		return n
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rollLocked()
	g := int(max(1, min(int64(n), b.max-b.used+1)))
	b.used += int64(g)
	return g
}

// refund gives back n reserved bytes a copy did not take.
func (b *budget) refund(n int) {
	if b.max <= 0 || n <= 0 {
		return
	}
	b.mu.Lock()
	b.used = max(0, b.used-int64(n))
	b.mu.Unlock()
}

// charge counts n bytes moved without a reservation.
func (b *budget) charge(n int) {
	if b.max <= 0 || n <= 0 {
		return
	}
	b.mu.Lock()
	b.rollLocked()
	b.used += int64(n)
	b.mu.Unlock()
}

// spent: the window's allowance is passed.
func (b *budget) spent() bool {
	if b.max <= 0 {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rollLocked()
	return b.used > b.max
}

// idle: no connection is open and the window ended, so the budget holds
// nothing a new one would not.
// hold counts one more open connection.
func (b *budget) hold() {
	b.mu.Lock()
	b.open++
	b.mu.Unlock()
}

func (b *budget) idle() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.open == 0 && (b.max <= 0 || b.window > 0 && b.now().Sub(b.start) >= b.window)
}
