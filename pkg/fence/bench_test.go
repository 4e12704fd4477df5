package fence_test

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bsm/redislock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

// BenchmarkFence compares, in one run against one private redis-server, the
// fenced lease cycle and guarded write with a raw EVALSHA and with two lock
// libraries. Each worker uses its own resource so the figures measure
// throughput, not contention. ops/s is the aggregate over all workers.
func BenchmarkFence(b *testing.B) {
	srv := redistest.Start(b)
	opt := srv.Options()
	opt.PoolSize = 128 // not the bottleneck at concurrency 64
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	const ttl = 10 * time.Second

	raw := redis.NewScript(`return 1`)
	locker := redislock.New(rdb)
	rs := redsync.New(goredis.NewPool(rdb))

	ops := []struct {
		name  string
		setup func(w int) func() error
	}{
		{"fenced-acquire-release", func(w int) func() error {
			res := "bench-fence-" + strconv.Itoa(w)
			return func() error {
				l, err := fence.Acquire(ctx, rdb, res, "o", ttl)
				if err != nil {
					return err
				}
				return l.Release(ctx)
			}
		}},
		{"guarded-write", func(w int) func() error {
			// A fresh resource each time: setup runs once per b.N round.
			res := "bench-guard-" + strconv.Itoa(w) + "-" + strconv.FormatInt(guardSeq.Add(1), 10)
			l, err := fence.Acquire(ctx, rdb, res, "o", time.Hour)
			if err != nil {
				b.Fatal(err)
			}
			key := fence.Key(res, "state")
			return func() error { return l.Guard(ctx, fence.Set(key, "v", 0)) }
		}},
		{"raw-evalsha", func(int) func() error {
			return func() error { return raw.Run(ctx, rdb, nil).Err() }
		}},
		{"redislock-obtain-release", func(w int) func() error {
			key := "bench-redislock-" + strconv.Itoa(w)
			return func() error {
				lock, err := locker.Obtain(ctx, key, ttl, nil)
				if err != nil {
					return err
				}
				return lock.Release(ctx)
			}
		}},
		{"redsync-lock-unlock", func(w int) func() error {
			m := rs.NewMutex("bench-redsync-"+strconv.Itoa(w), redsync.WithExpiry(ttl), redsync.WithTries(1))
			return func() error {
				if err := m.LockContext(ctx); err != nil {
					return err
				}
				_, err := m.UnlockContext(ctx)
				return err
			}
		}},
	}
	for _, conc := range []int{1, 8, 64} {
		for _, op := range ops {
			b.Run("conc="+strconv.Itoa(conc)+"/op="+op.name, func(b *testing.B) {
				fns := make([]func() error, conc)
				for w := range fns {
					fns[w] = op.setup(w)
				}
				runConcurrent(b, fns)
			})
		}
	}
}

var guardSeq atomic.Int64

// runConcurrent runs b.N calls split over one goroutine per fn (exactly
// len(fns) goroutines, unlike RunParallel whose count is a multiple of
// GOMAXPROCS).
func runConcurrent(b *testing.B, fns []func() error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for _, fn := range fns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(b.N) {
				if err := fn(); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "ops/s")
}
