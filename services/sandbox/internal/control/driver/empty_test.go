package driver

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Calls that only talk to a route (Deliver, Abort, UpdateEgress, Route,
// RotateHandle, SuspendRoute, worktree calls) on sandboxes this
// replica does not drive take none of them over: no owner lease, no
// goroutine, no Redis key per id asked about. A release of an unknown
// session takes the sandbox (its absence must be verified) and the tick lets
// the empty sandbox go: records, sbx:index entry and owner lease.
func TestTalkingToASandboxDoesNotTakeItOver(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 1)}
	wr := &heldWrappers{stopped: make(chan string, 1024), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, nil)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	goroutines := runtime.NumGoroutine()

	for i := range 300 {
		id := fmt.Sprintf("sbx-unknown%d", i)
		sent, _, err := d.Deliver(ctx, id, "s1", []Message{{ID: "m1", Content: "hi"}})
		require.ErrorIs(t, err, ErrRouteNotFound)
		require.False(t, sent)
		_, err = d.Abort(ctx, id, "s1", "m1")
		require.ErrorIs(t, err, ErrRouteNotFound)
		applied, err := d.UpdateEgress(ctx, id, "s1", egresspolicy.Policy{}, 1)
		require.NoError(t, err)
		require.False(t, applied)
		_, found, err := d.Route(ctx, id, "s1")
		require.NoError(t, err)
		require.False(t, found)
		_, err = d.RotateHandle(ctx, id, "s1")
		require.ErrorIs(t, err, ErrRouteNotFound)
		sus, err := d.SuspendRoute(ctx, id, "s1")
		require.NoError(t, err)
		require.True(t, sus.AbsenceVerified, "no route: nothing of the session runs")
	}
	require.Zero(t, d.OwnedCount(), "no sandbox was taken over by talking to it")
	require.Zero(t, d.cfg.Redis.DBSize(ctx).Val(), "no key was written for an id asked about")
	require.LessOrEqual(t, runtime.NumGoroutine(), goroutines+2, "no goroutine per id asked about")

	for i := range 50 {
		_, err := d.ReleaseRoute(ctx, fmt.Sprintf("sbx-released%d", i), "s1", ReasonSessionDelete)
		require.NoError(t, err)
	}
	require.Equal(t, 50, d.OwnedCount(), "a release verifies absence as the owner")
	d.tick(ctx)
	require.Zero(t, d.OwnedCount(), "the tick lets every empty sandbox go")
	require.Empty(t, d.cfg.Redis.SMembers(ctx, store.IndexKey).Val(), "sbx:index is cleaned up")
	keys := d.cfg.Redis.Keys(ctx, "*").Val()
	for _, k := range keys {
		require.Regexp(t, `^fence:\{sbx/sbx-released\d+\}:token$`, k, "only the fence token counters stay")
	}
	require.Eventually(t, func() bool { return runtime.NumGoroutine() <= goroutines+2 }, 10*time.Second, 10*time.Millisecond,
		"the released sandboxes' renewals and watchers end")
}

// An empty sandbox stays owned while it has something to drive: a route
// prepared in it keeps it, and it goes only once the route is forgotten.
func TestAPreparedSandboxIsKept(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, nil)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: "sbx-kept", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	<-prov.launched
	d.tick(ctx)
	require.Equal(t, 1, d.OwnedCount(), "a sandbox with a route is kept")
	require.Equal(t, []string{"sbx-kept"}, d.cfg.Redis.SMembers(ctx, store.IndexKey).Val())
	// Another replica's talk about it is answered by this one's state.
	_, found, err := d.Route(ctx, "sbx-kept", "s1")
	require.NoError(t, err)
	require.True(t, found)
}

// Issue 35 item 5: open routes are counted by whether their runtime runs:
// a prepared route's is running (launched), a suspended one's is stopped,
// a released route is no longer open.
func TestRouteCountsFollowTheRuntime(t *testing.T) {
	prov := &recordingProvider{launched: make(chan launchedWrapper, 4)}
	wr := &heldWrappers{stopped: make(chan string, 4), launched: map[string]provider.Markers{}}
	d := newTestDriver(t, prov, wr, nil)
	t.Cleanup(d.dropAll)
	ctx := context.Background()
	running, stopped := d.RouteCounts()
	require.Zero(t, running+stopped, "nothing open")

	_, err := d.Prepare(ctx, RouteSpec{SessionID: "s1", SandboxID: "sbx-counted", Directory: "/repo", CredentialClass: "static"})
	require.NoError(t, err)
	<-prov.launched
	running, stopped = d.RouteCounts()
	require.Equal(t, [2]int{1, 0}, [2]int{running, stopped}, "the launched runtime runs")

	_, err = d.SuspendRoute(ctx, "sbx-counted", "s1")
	require.NoError(t, err)
	running, stopped = d.RouteCounts()
	require.Equal(t, [2]int{0, 1}, [2]int{running, stopped}, "a suspended route is open, its runtime stopped")

	_, err = d.ReleaseRoute(ctx, "sbx-counted", "s1", ReasonSessionDelete)
	require.NoError(t, err)
	running, stopped = d.RouteCounts()
	require.Zero(t, running+stopped, "a released route is not open")
}
