// Package expiring is a bounded map whose entries expire a fixed time after
// they were put: for keeping what was used lately (a cache, a reuse window)
// without keeping everything ever seen. Expired entries are refused at once
// and swept out by a later Put, at most once per sweep period, as a sweep is
// a pass over the whole map. The clock is the caller's: every call that
// needs the time takes it, so tests drive it.
package expiring

import (
	"sync"
	"time"
)

// Options configure a Map.
type Options struct {
	// TTL: an entry put at t is expired from t+TTL on.
	TTL time.Duration
	// SweepEvery: a Put drops the expired entries when the last sweep is at
	// least this old.
	SweepEvery time.Duration
	// Max (at least 1) bounds the entries: a Put of a new key into a full map
	// drops an arbitrary entry first. One at a time, not the whole map: the
	// others stay usable, so a full map costs a miss per new key rather than
	// a burst of misses for every key in use.
	Max int
	// FutureExpired makes an entry put after now expired too, for a value
	// that must not be used before its stamp (or a clock that may step back).
	FutureExpired bool
}

// Map is safe for concurrent use; Get takes only a read lock.
type Map[K comparable, V any] struct {
	opts      Options
	mu        sync.RWMutex
	m         map[K]entry[V]
	lastSweep time.Time
}

type entry[V any] struct {
	v  V
	at time.Time // when it was put
}

// New returns an empty Map.
func New[K comparable, V any](o Options) *Map[K, V] {
	return &Map[K, V]{opts: o, m: map[K]entry[V]{}}
}

func (m *Map[K, V]) expired(at, now time.Time) bool {
	return now.Sub(at) >= m.opts.TTL || m.opts.FutureExpired && now.Before(at)
}

// Get returns k's value unless it is missing or expired at now. It leaves an
// expired entry for a sweep, so that reads never wait for the write lock.
func (m *Map[K, V]) Get(k K, now time.Time) (v V, ok bool) {
	m.mu.RLock()
	e, ok := m.m[k]
	m.mu.RUnlock()
	if !ok || m.expired(e.at, now) {
		return v, false
	}
	return e.v, true
}

// Put stores v under k, stamped now. The sweep runs before the bound, so a
// full map drops a live entry only when it holds no expired one.
func (m *Map[K, V]) Put(k K, v V, now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if now.Sub(m.lastSweep) >= m.opts.SweepEvery {
		m.lastSweep = now
		for x, e := range m.m {
			if m.expired(e.at, now) {
				delete(m.m, x)
			}
		}
	}
	if _, ok := m.m[k]; !ok && len(m.m) >= m.opts.Max {
		for x := range m.m {
			delete(m.m, x)
			break
		}
	}
	m.m[k] = entry[V]{v: v, at: now}
}

// Delete drops k's entry.
func (m *Map[K, V]) Delete(k K) {
	m.mu.Lock()
	delete(m.m, k)
	m.mu.Unlock()
}

// DeleteFunc drops the entries for which del returns true, expired or not.
// del runs under the write lock: it must not call the Map.
func (m *Map[K, V]) DeleteFunc(del func(K, V) bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k, e := range m.m {
		if del(k, e.v) {
			delete(m.m, k)
		}
	}
}

// Len is the number of entries held, expired ones not yet swept included.
func (m *Map[K, V]) Len() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.m)
}
