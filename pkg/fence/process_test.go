package fence_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

// Helper processes are this test binary re-executed with helperEnv set;
// TestMain dispatches to runHelper. They talk to the parent through Redis
// lists.
const (
	helperEnv   = "FENCE_TEST_HELPER"
	helperURL   = "FENCE_TEST_REDIS_URL"
	helperID    = "FENCE_TEST_ID"
	resultsList = "test:results"
)

func runHelper(mode string) int {
	opt, err := redis.ParseURL(os.Getenv(helperURL))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	id := os.Getenv(helperID)
	switch mode {
	case "acquirer":
		err = helperAcquirer(rdb, id)
	case "paused-holder":
		err = helperPausedHolder(rdb, id)
	default:
		err = fmt.Errorf("unknown helper mode %q", mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// helperAcquirer tries to acquire "mp" once per round the parent announces
// on its go list, and reports "round id token" (token 0: not acquired).
func helperAcquirer(rdb *redis.Client, id string) error {
	for {
		v, err := rdb.BLPop(ctx, 0, "test:go:"+id).Result()
		if err != nil {
			return err
		}
		if v[1] == "stop" {
			return nil
		}
		var tok uint64
		// The TTL outlasts any scheduling delay of a loaded machine: the
		// parent ends each lease period itself.
		l, err := fence.Acquire(ctx, rdb, "mp", "proc-"+id, time.Minute)
		switch {
		case err == nil:
			tok = l.Token
		case !errors.Is(err, fence.ErrLeaseHeld):
			return err
		}
		if err := rdb.RPush(ctx, resultsList, fmt.Sprintf("%s %s %d", v[1], id, tok)).Err(); err != nil {
			return err
		}
	}
}

// helperPausedHolder holds "sp" and keeps writing its name with its token,
// ignoring Done on purpose (a buggy or paused holder): only fencing may stop
// it. It exits after its first rejected write.
func helperPausedHolder(rdb *redis.Client, id string) error {
	h, err := fence.Hold(ctx, rdb, "sp", "child", 150*time.Millisecond)
	if err != nil {
		return err
	}
	if err := rdb.RPush(ctx, resultsList, "ready "+strconv.FormatUint(h.Token(), 10)).Err(); err != nil {
		return err
	}
	for {
		err := h.Guard(ctx, fence.Set(fence.Key("sp", "state"), "child", 0))
		if errors.Is(err, fence.ErrStaleToken) {
			_ = h.Release(ctx)
			return rdb.RPush(ctx, resultsList, "rejected").Err()
		}
		if err != nil {
			return err
		}
		time.Sleep(time.Millisecond)
	}
}

func startHelper(t *testing.T, srv *redistest.Server, mode, id string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode, helperURL+"="+srv.URL(), helperID+"="+id)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd
}

func popResult(t *testing.T, rdb *redis.Client) string {
	t.Helper()
	v, err := rdb.BLPop(ctx, 30*time.Second, resultsList).Result()
	require.NoError(t, err, "helper process did not report")
	return v[1]
}

func TestConcurrentProcessesOneHolderPerPeriod(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const procs, rounds = 4, 6
	cmds := make([]*exec.Cmd, procs)
	for i := range procs {
		cmds[i] = startHelper(t, srv, "acquirer", strconv.Itoa(i))
	}
	var last uint64
	for round := range rounds {
		// A new lease period: the parent ends the last one, as expiry would,
		// so a slow acquirer cannot land in the next period by accident.
		require.NoError(t, rdb.Del(ctx, fence.LeaseKey("mp")).Err())
		for i := range procs {
			require.NoError(t, rdb.RPush(ctx, "test:go:"+strconv.Itoa(i), strconv.Itoa(round)).Err())
		}
		winners := 0
		for range procs {
			f := strings.Fields(popResult(t, rdb))
			require.Len(t, f, 3)
			require.Equal(t, strconv.Itoa(round), f[0])
			tok, err := strconv.ParseUint(f[2], 10, 64)
			require.NoError(t, err)
			if tok != 0 {
				winners++
				require.Greater(t, tok, last)
				last = tok
			}
		}
		require.Equal(t, 1, winners, "round %d", round)
	}
	for i := range procs {
		require.NoError(t, rdb.RPush(ctx, "test:go:"+strconv.Itoa(i), "stop").Err())
	}
	for _, c := range cmds {
		require.NoError(t, c.Wait())
	}
}

// A real child process holds the lease and writes in a loop; it is frozen
// with SIGSTOP past its TTL, B takes over and writes, then the child is
// resumed: its writes must all be rejected.
func TestPausedHolderChildProcess(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	k := fence.Key("sp", "state")
	for range 2 {
		child := startHelper(t, srv, "paused-holder", "0")
		f := strings.Fields(popResult(t, rdb))
		require.Equal(t, "ready", f[0])
		childTok, err := strconv.ParseUint(f[1], 10, 64)
		require.NoError(t, err)

		require.NoError(t, child.Process.Signal(syscall.SIGSTOP))
		waitGone(t, rdb, fence.LeaseKey("sp"))
		b, err := fence.Acquire(ctx, rdb, "sp", "B", time.Minute)
		require.NoError(t, err)
		require.Greater(t, b.Token, childTok)
		require.NoError(t, b.Guard(ctx, fence.Set(k, "B", 0)))

		require.NoError(t, child.Process.Signal(syscall.SIGCONT))
		require.Equal(t, "rejected", popResult(t, rdb))
		require.NoError(t, child.Wait())
		require.Equal(t, "B", rdb.Get(ctx, k).Val(), "a stale write was accepted")
		require.NoError(t, b.Release(ctx))
	}
}
