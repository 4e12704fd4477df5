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
// context ends, or until the lease is lost. Done closes as soon as the
// holder can no longer be sure it holds the lease: a renewal that finds the
// lease lost, or the local lease deadline passing without a renewal (Redis
// down, paused or failing over for longer). A renewal Redis could not answer
// is retried within the deadline, so a lease that survives a Redis failover
// or restart stays held. Writes must still be guarded: a
// process can be paused between checking Done and writing.
type Holder struct {
	lease *Lease
	done  chan struct{}
	stop  chan struct{}
	wg    sync.WaitGroup

	mu       sync.Mutex
	err      error
	closed   bool
	watchdog *time.Timer
}

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
	// acquire), so the timer can fire at once: lose reads h.watchdog under
	// h.mu, which is held until it is set.
	h.mu.Lock()
	h.watchdog = time.AfterFunc(ttl-time.Since(begin), func() {
		h.lose(fmt.Errorf("%w: lease deadline passed without renewal", ErrLeaseLost))
	})
	h.mu.Unlock()
	h.wg.Add(1)
	go h.renew(ctx)
	return h, nil
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
		if err := h.lease.Renew(ctx); err != nil {
			if errors.Is(err, ErrLeaseLost) || ctx.Err() != nil {
				h.lose(fmt.Errorf("%w: %w", ErrLeaseLost, err))
				return
			}
			// Redis could not answer (down, failing over, the renewal not
			// confirmed on its replicas): the lease may well have survived,
			// so try again soon; the watchdog still closes Done once the
			// local deadline passes without a renewal.
			t.Reset(retryInterval(interval))
			continue
		}
		t.Reset(interval)
		h.mu.Lock()
		if !h.closed {
			h.watchdog.Reset(h.lease.TTL - time.Since(begin))
		}
		h.mu.Unlock()
	}
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
		close(h.done)
	}
	h.mu.Unlock()
	return err
}
