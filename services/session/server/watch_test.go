package server

import (
	"context"
	"io"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

func (e *env) emitRuntime(sid, id string) {
	e.t.Helper()
	_, err := e.notify.NotifyRuntimeEvents(e.ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: e.route(sid, 1),
		Events: []*runtimev1.RuntimeEvent{{EventId: id, Kind: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_PROGRESS, Text: id}}})
	require.NoError(e.t, err)
}

// recvRuntimeText waits for the stream's next runtime event.
func recvRuntimeText(t *testing.T, s sessionv1.SessionService_WatchSessionClient) string {
	t.Helper()
	for {
		resp, err := s.Recv()
		require.NoError(t, err)
		if ev := resp.GetEvent().GetRuntimeEvent(); ev != nil {
			return ev.GetText()
		}
	}
}

// blockedReaders is how many Redis clients sit in a blocking command.
func (e *env) blockedReaders() int {
	e.t.Helper()
	info, err := e.rdb.Info(context.Background(), "clients").Result()
	require.NoError(e.t, err)
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "blocked_clients:"); ok {
			n, err := strconv.Atoi(v)
			require.NoError(e.t, err)
			return n
		}
	}
	e.t.Fatal("no blocked_clients in INFO clients")
	return 0
}

// A watcher whose client went away, or whose service shuts down, must end
// at once and free its Redis connection, not sit in XREAD BLOCK until the
// block timeout (here far longer than the test's polling bound, so only a
// cut-short read passes). With one watch connection, a second watcher is
// then served too.
func TestCancelledWatchFreesItsConnectionAtOnce(t *testing.T) {
	e := newEnv(t, func(c *Config) {
		c.WatchPoolSize = 1
		c.WatchBlock = time.Minute
	})
	e.create("s1", "u1", "/work/repo")

	ctx, cancel := context.WithCancel(e.ctx)
	s1, err := e.api.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	e.emitRuntime("s1", "a0")
	require.Equal(t, "a0", recvRuntimeText(t, s1))
	eventually(t, func() bool { return e.blockedReaders() == 1 }, "the watcher to block in XREAD")
	cancel()
	for err == nil {
		_, err = s1.Recv()
	}
	require.Equal(t, codes.Canceled, status.Code(err))
	eventually(t, func() bool { return e.blockedReaders() == 0 }, "the cancelled watcher's read to end")

	s2, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1", Cursor: "$"})
	require.NoError(t, err)
	eventually(t, func() bool { return e.blockedReaders() == 1 }, "the second watcher to get the connection")
	e.emitRuntime("s1", "b0")
	require.Equal(t, "b0", recvRuntimeText(t, s2))

	// Shutdown ends the live watcher the same way.
	e.svc.Close()
	for err == nil {
		_, err = s2.Recv()
	}
	require.Equal(t, io.EOF, err)
	eventually(t, func() bool { return e.blockedReaders() == 0 }, "the watcher's read to end on shutdown")
	// The closed connections of ended watchers are not errors.
	require.NotContains(t, e.logs.String(), "internal error")
}

// A Redis outage under a live watcher ends its stream with an error the
// client sees (it reconnects with its cursor), not as a quiet cancellation.
func TestWatchSurfacesRedisOutage(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.WatchBlock = 30 * time.Second })
	e.create("s1", "u1", "/work/repo")
	s1, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	e.emitRuntime("s1", "a0")
	require.Equal(t, "a0", recvRuntimeText(t, s1)) // replayed, then it follows
	require.NoError(t, e.redis.Kill())
	for err == nil {
		_, err = s1.Recv()
	}
	require.Equal(t, codes.Unavailable, status.Code(err), "got %v", err)
	require.Equal(t, apierr.ReasonStoreUnavailable, apierr.Reason(err), "got %v", err)
	e.redis.Start(t)
	// go-redis probes a failed dial in the background for up to a second
	// after the watcher's client closed; let it end before goleak looks.
	eventually(t, func() bool {
		buf := make([]byte, 1<<20)
		return !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "(*ConnPool).tryDial")
	}, "go-redis dial probes to end")
}
