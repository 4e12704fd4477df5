package expiring

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

func TestGetRefusesExpired(t *testing.T) {
	const ttl = time.Second
	for _, c := range []struct {
		name   string
		age    time.Duration // of the entry at the Get
		future bool          // FutureExpired
		ok     bool
	}{
		{"just put", 0, false, true},
		{"just before ttl", ttl - 1, false, true},
		{"at ttl", ttl, false, false},
		{"past ttl", 2 * ttl, false, false},
		{"put after now", -1, false, true},
		{"put after now, future expired", -1, true, false},
		{"just put, future expired", 0, true, true},
		{"at ttl, future expired", ttl, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := New[string, int](Options{TTL: ttl, SweepEvery: ttl, Max: 10, FutureExpired: c.future})
			m.Put("k", 7, t0)
			v, ok := m.Get("k", t0.Add(c.age))
			require.Equal(t, c.ok, ok)
			if ok {
				require.Equal(t, 7, v)
			}
			require.Equal(t, 1, m.Len(), "a Get drops nothing")
		})
	}
}

// A Put sweeps the expired entries only once the last sweep is SweepEvery
// old, and the next sweep counts from that one.
func TestSweepCadence(t *testing.T) {
	const every = 10 * time.Second
	m := New[string, int](Options{TTL: time.Second, SweepEvery: every, Max: 100})
	m.Put("a", 1, t0) // the first Put sweeps (an empty map)
	m.Put("b", 2, t0)
	m.Put("c", 3, t0.Add(every-1))
	require.Equal(t, 3, m.Len(), "no sweep before SweepEvery")
	_, ok := m.Get("a", t0.Add(every-1))
	require.False(t, ok, "an expired entry is refused before it is swept")

	m.Put("d", 4, t0.Add(every))
	require.Equal(t, 2, m.Len(), "a and b swept, c still live")
	_, ok = m.Get("c", t0.Add(every))
	require.True(t, ok)

	m.Put("e", 5, t0.Add(2*every-1))
	require.Equal(t, 3, m.Len(), "no sweep before SweepEvery after the last one")
	m.Put("f", 6, t0.Add(2*every))
	require.Equal(t, 2, m.Len(), "c and d swept, e still live")
}

func TestBound(t *testing.T) {
	m := New[int, int](Options{TTL: time.Hour, SweepEvery: time.Hour, Max: 3})
	for k := range 3 {
		m.Put(k, k, t0)
	}
	for i := range 30 { // a key already held takes no room
		m.Put(i%3, i, t0)
	}
	for k := range 3 {
		_, ok := m.Get(k, t0)
		require.True(t, ok)
	}
	m.Put(3, 3, t0)
	require.Equal(t, 3, m.Len(), "a new key drops one entry")
	v, ok := m.Get(3, t0)
	require.True(t, ok)
	require.Equal(t, 3, v)
	held := 0
	for k := range 3 {
		if _, ok := m.Get(k, t0); ok {
			held++
		}
	}
	require.Equal(t, 2, held, "only one dropped")
}

// The sweep runs before the bound: a full map holding an expired entry
// drops that one, never a live one. Repeated, as the bound drops an
// arbitrary entry (a live one 9 times in 10 were the order reversed).
func TestSweepBeforeBound(t *testing.T) {
	const ttl = time.Second
	for range 20 {
		m := New[int, int](Options{TTL: ttl, SweepEvery: ttl, Max: 10})
		m.Put(0, 0, t0)
		for k := 1; k < 10; k++ {
			m.Put(k, k, t0.Add(ttl/2))
		}
		m.Put(10, 10, t0.Add(ttl))
		require.Equal(t, 10, m.Len())
		for k := 1; k <= 10; k++ {
			_, ok := m.Get(k, t0.Add(ttl))
			require.True(t, ok, "key %d", k)
		}
	}
}

func TestDelete(t *testing.T) {
	m := New[int, int](Options{TTL: time.Second, SweepEvery: time.Hour, Max: 100})
	for k := range 10 {
		m.Put(k, k*10, t0)
	}
	m.Delete(3)
	m.Delete(42) // absent: nothing happens
	_, ok := m.Get(3, t0)
	require.False(t, ok)
	require.Equal(t, 9, m.Len())

	var seen int
	m.DeleteFunc(func(k, v int) bool {
		seen++
		require.Equal(t, k*10, v)
		return k%2 == 0
	})
	require.Equal(t, 9, seen, "asked about every entry")
	require.Equal(t, 4, m.Len())
	for k := range 10 {
		_, ok := m.Get(k, t0)
		require.Equal(t, k%2 == 1 && k != 3, ok, "key %d", k)
	}
	m.DeleteFunc(func(int, int) bool { return true })
	require.Equal(t, 0, m.Len())
}

// Against a reference model, over random Puts, Deletes and clock steps (some
// backwards): with room enough the Map is the model; with a small bound it
// holds at most Max of the model's live entries, never another value.
func TestAgainstModel(t *testing.T) {
	const ttl, every = 10 * time.Second, 3 * time.Second
	type ent struct {
		v  int
		at time.Time
	}
	for _, max := range []int{1000, 4} {
		rng := rand.New(rand.NewPCG(1, uint64(max)))
		m := New[int, int](Options{TTL: ttl, SweepEvery: every, Max: max})
		model, lastSweep, now := map[int]ent{}, time.Time{}, t0
		for i := range 5000 {
			now = now.Add(time.Duration(rng.IntN(4000)-500) * time.Millisecond)
			k := rng.IntN(20)
			if rng.IntN(5) == 0 {
				m.Delete(k)
				delete(model, k)
			} else {
				m.Put(k, i, now)
				if now.Sub(lastSweep) >= every {
					lastSweep = now
					for x, e := range model {
						if now.Sub(e.at) >= ttl {
							delete(model, x)
						}
					}
				}
				model[k] = ent{i, now}
			}
			if max == 1000 {
				require.Equal(t, len(model), m.Len(), "op %d", i)
			} else {
				require.LessOrEqual(t, m.Len(), max)
			}
			for x := range 20 {
				v, ok := m.Get(x, now)
				e, held := model[x]
				live := held && now.Sub(e.at) < ttl
				if max == 1000 || ok {
					require.Equal(t, live, ok, "op %d key %d", i, x)
				}
				if ok {
					require.Equal(t, e.v, v, "op %d key %d", i, x)
				}
			}
		}
	}
}

// Run with -race: Gets under the read lock alongside the writers.
func TestConcurrentUse(t *testing.T) {
	m := New[int, int](Options{TTL: time.Millisecond, SweepEvery: time.Millisecond, Max: 50})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 2000 {
				now := t0.Add(time.Duration(i) * time.Microsecond)
				m.Put(g*1000+i%100, i, now)
				m.Get(i%100, now)
				if i%100 == 0 {
					m.DeleteFunc(func(k, _ int) bool { return k%3 == 0 })
				}
			}
		})
	}
	wg.Wait()
	require.LessOrEqual(t, m.Len(), 50)
}
