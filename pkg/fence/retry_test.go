package fence_test

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

// slowProxy forwards TCP to a redis-server; armed, it holds back the next
// reply chunk (of any connection) past the client's read timeout, once:
// the command ran, its caller timed out, and go-redis may send it again on
// a fresh connection, whose reply passes.
type slowProxy struct {
	addr  string
	armed atomic.Bool
	delay time.Duration
	wg    sync.WaitGroup
}

func startSlowProxy(t *testing.T, target string, delay time.Duration) *slowProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &slowProxy{addr: l.Addr().String(), delay: delay}
	var conns sync.Map
	t.Cleanup(func() {
		_ = l.Close()
		conns.Range(func(k, _ any) bool { _ = k.(net.Conn).Close(); return true })
		p.wg.Wait()
	})
	p.wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			conns.Store(c, true)
			conns.Store(s, true)
			p.wg.Go(func() { _, _ = io.Copy(s, c); _ = s.Close() })
			p.wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 32<<10)
				for {
					n, err := s.Read(buf)
					if n > 0 {
						if p.armed.CompareAndSwap(true, false) {
							time.Sleep(p.delay)
						}
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			})
		}
	})
	return p
}

// Issue 18 item 12: go-redis resends a command after a read timeout. The
// scripts that are not safe to repeat (acquire, release, a caller's guarded
// script such as a compare-and-set) go out without retries: after a timeout
// the caller gets the timeout, never a wrong answer computed by a second run
// (an acquire reporting its own grant as held, a compare-and-set reporting a
// conflict after applying, a release reporting the lease lost).
func TestScriptsThatAreNotSafeToRepeatAreNeverResent(t *testing.T) {
	srv := redistest.Start(t)
	proxy := startSlowProxy(t, srv.Addr(), 600*time.Millisecond)
	rdb := redis.NewClient(&redis.Options{Addr: proxy.addr, ReadTimeout: 150 * time.Millisecond, MaxRetries: 3,
		MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 2 * time.Millisecond})
	t.Cleanup(func() { _ = rdb.Close() })
	direct := srv.Client(t)
	ctx := context.Background()
	require.NoError(t, rdb.Ping(ctx).Err())
	// Load the scripts first: a delayed NOSCRIPT reply would mean nothing ran.
	warm, err := fence.Acquire(ctx, rdb, "r-warm", "me", time.Minute)
	require.NoError(t, err)
	require.NoError(t, warm.Renew(ctx))
	require.NoError(t, warm.Release(ctx))

	// Acquire: it ran once (the lease exists), and the caller is not told "held".
	proxy.armed.Store(true)
	_, err = fence.Acquire(ctx, rdb, "r-acq", "me", time.Minute)
	require.Error(t, err)
	require.NotErrorIs(t, err, fence.ErrLeaseHeld, "a resent acquire found its own grant")
	require.Equal(t, int64(1), direct.Exists(ctx, fence.LeaseKey("r-acq")).Val(), "the acquire ran")

	// A compare-and-set guarded script: it applied, and no conflict is reported.
	l, err := fence.Acquire(ctx, rdb, "r-cas", "me", time.Minute)
	require.NoError(t, err)
	cas := fence.NewGuardedScript(`
if (redis.call('GET', KEYS[2]) or '') ~= ARGV[2] then return redis.error_reply('CONFLICT') end
redis.call('SET', KEYS[2], ARGV[3])
return 1`)
	require.NoError(t, cas.Run(ctx, rdb, "r-cas", l.Token, []string{fence.Key("r-cas", "warm")}, "", "x").Err())
	key := fence.Key("r-cas", "v")
	proxy.armed.Store(true)
	err = cas.Run(ctx, rdb, "r-cas", l.Token, []string{key}, "", "v1").Err()
	require.Error(t, err)
	require.NotContains(t, err.Error(), "CONFLICT", "a resent compare-and-set reported a conflict after applying")
	require.Equal(t, "v1", direct.Get(ctx, key).Val(), "the compare-and-set applied once")

	// Release: it ran once, and the caller is not told the lease was lost.
	require.NoError(t, rdb.Ping(ctx).Err()) // a fresh connection (the timed-out one is closed) past its handshake
	proxy.armed.Store(true)
	err = l.Release(ctx)
	require.Error(t, err)
	require.NotErrorIs(t, err, fence.ErrLeaseLost, "a resent release found the lease gone")
	require.Zero(t, direct.Exists(ctx, fence.LeaseKey("r-cas")).Val(), "the release ran")

	// Safe-to-repeat calls keep go-redis' retries: a renewal survives the timeout.
	l2, err := fence.Acquire(ctx, rdb, "r-renew", "me", time.Minute)
	require.NoError(t, err)
	require.NoError(t, rdb.Ping(ctx).Err())
	proxy.armed.Store(true)
	require.NoError(t, l2.Renew(ctx), "a renewal is safe to resend")
	require.NoError(t, l2.Guard(ctx, fence.Set(fence.Key("r-renew", "x"), "1", 0)))
}
