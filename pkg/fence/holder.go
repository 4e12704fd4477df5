package fence

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Holder holds a lease and renews it every TTL/3 until Release, until its
// context ends, or until the lease is lost. Done closes when the lease is
// lost: a renewal that finds another token or owner in the lease, or the
// lease gone while the last renewal was confirmed. A renewal Redis could not
// answer or confirm (down, failing over, its replicas behind:
// STORE_NOT_REPLICATED) is not a loss: it is retried, past the lease's
// deadline too, and once Redis answers again the lease is extended, or
// recreated with the same token if it expired while nobody else was granted
// it (reclaimScript), so a failover longer than the TTL does not make the
// sole holder give its resources up. Past the deadline without a confirmed
// renewal the holder is Unconfirmed (another holder may have been granted
// the lease meanwhile: act on nothing that needs it held); after giveUpTTLs
// TTLs without one, Done closes (a holder cut off from Redis lets go).
// Writes must still be guarded: a process can be paused between checking
// Done and writing.
type Holder struct {
	lease *Lease
	done  chan struct{}
	stop  chan struct{}
	wg    sync.WaitGroup

	mu       sync.Mutex
	err      error
	closed   bool
	watchdog *time.Timer
	// outOfContact: a renewal failed without an answer since the last
	// confirmed one; pastDeadline: the lease's deadline passed meanwhile.
	outOfContact, pastDeadline bool
	giveUp                     *time.Timer
}

// giveUpTTLs is how many TTLs without a confirmed renewal a holder waits
// before it gives the lease up.
const giveUpTTLs = 5

// Hold acquires the lease (see Acquire) and starts renewing it. ctx bounds
// the holder's life: when it ends, renewal stops and Done closes.
func Hold(ctx context.Context, rdb redis.Scripter, resource, owner string, ttl time.Duration) (*Holder, error) {
	begin := time.Now()
	l, err := Acquire(ctx, rdb, resource, owner, ttl)
	if err != nil {
		return nil, err
	}
	h := &Holder{lease: l, done: make(chan struct{}), stop: make(chan struct{})}
	// Redis started the TTL after begin, so begin+ttl is a safe local
	// deadline. The deadline may already have passed (a slow or paused
	// acquire), so the timer can fire at once: the callbacks read the
	// timers under h.mu, which is held until both are set.
	h.mu.Lock()
	h.watchdog = time.AfterFunc(ttl-time.Since(begin), h.deadlinePassed)
	h.giveUp = time.AfterFunc(giveUpTTLs*ttl-time.Since(begin), func() {
		h.lose(fmt.Errorf("%w: no renewal confirmed for %d TTLs", ErrLeaseLost, giveUpTTLs))
	})
	h.mu.Unlock()
	h.wg.Add(1)
	go h.renew(ctx)
	return h, nil
}

// deadlinePassed marks the lease unconfirmed: its deadline passed without
// a confirmed renewal.
func (h *Holder) deadlinePassed() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.closed {
		h.pastDeadline = true
	}
}

// Unconfirmed reports whether the lease's deadline passed without a
// confirmed renewal: the holder has not lost it, but cannot tell whether
// another holder was granted it meanwhile.
func (h *Holder) Unconfirmed() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.pastDeadline && !h.closed
}

func (h *Holder) renew(ctx context.Context) {
	defer h.wg.Done()
	interval := h.lease.TTL / 3
	if interval <= 0 {
		interval = time.Millisecond
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-h.stop:
			return
		case <-h.done:
			return
		case <-ctx.Done():
			h.lose(fmt.Errorf("%w: %w", ErrLeaseLost, ctx.Err()))
			return
		case <-t.C:
		}
		begin := time.Now()
		err := h.renewOnce(ctx)
		switch {
		case err == nil:
		case errors.Is(err, ErrLeaseLost) || ctx.Err() != nil:
			h.lose(fmt.Errorf("%w: %w", ErrLeaseLost, err))
			return
		default:
			// Redis could not answer or confirm: the lease may well have
			// survived, so try again soon.
			h.mu.Lock()
			h.outOfContact = true
			h.mu.Unlock()
			t.Reset(retryInterval(interval))
			continue
		}
		t.Reset(interval)
		h.mu.Lock()
		if !h.closed {
			h.outOfContact, h.pastDeadline = false, false
			h.watchdog.Reset(h.lease.TTL - time.Since(begin))
			h.giveUp.Reset(giveUpTTLs*h.lease.TTL - time.Since(begin))
		}
		h.mu.Unlock()
	}
}

// renewOnce renews the lease; a holder that lost contact with Redis since
// its last confirmed renewal may also reclaim it (reclaimScript), and so may
// one whose renewal found the lease gone only after it lost contact.
func (h *Holder) renewOnce(ctx context.Context) error {
	h.mu.Lock()
	outOfContact := h.outOfContact || h.pastDeadline
	h.mu.Unlock()
	if outOfContact {
		return h.lease.reclaim(ctx)
	}
	err := h.lease.Renew(ctx)
	if errors.Is(err, ErrLeaseLost) {
		h.mu.Lock()
		outOfContact = h.outOfContact || h.pastDeadline
		h.mu.Unlock()
		if outOfContact {
			return h.lease.reclaim(ctx)
		}
	}
	return err
}

// retryInterval is how soon a renewal that Redis could not answer is tried
// again: several tries fit before the lease's deadline.
func retryInterval(interval time.Duration) time.Duration {
	return max(interval/5, time.Millisecond)
}

// lose records why the lease is gone and closes Done once.
func (h *Holder) lose(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return
	}
	h.closed, h.err = true, err
	h.watchdog.Stop()
	h.giveUp.Stop()
	close(h.done)
}

// Lease is the held lease (its Token fences writes).
func (h *Holder) Lease() *Lease { return h.lease }

// Token is the lease's fencing token.
func (h *Holder) Token() uint64 { return h.lease.Token }

// Done closes when the lease is lost or released.
func (h *Holder) Done() <-chan struct{} { return h.done }

// Err says why Done closed (wrapping ErrLeaseLost), nil while held or after
// a successful Release.
func (h *Holder) Err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// Guard runs a guarded write with the held token.
func (h *Holder) Guard(ctx context.Context, ops ...Op) error { return h.lease.Guard(ctx, ops...) }

// Release stops renewing and releases the lease. It returns ErrLeaseLost if
// the lease was already lost. Safe to call more than once.
func (h *Holder) Release(ctx context.Context) error {
	h.mu.Lock()
	select {
	case <-h.stop:
	default:
		close(h.stop)
	}
	h.mu.Unlock()
	h.wg.Wait()
	if err := h.Err(); err != nil {
		return err
	}
	err := h.lease.Release(ctx)
	h.mu.Lock()
	if !h.closed {
		h.closed = true
		h.err = err // nil on a clean release
		h.watchdog.Stop()
		h.giveUp.Stop()
		close(h.done)
	}
	h.mu.Unlock()
	return err
}
