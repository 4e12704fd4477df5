package server

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/apierr/apierrtest"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// Issue 18 item 4: a zero or forged (far-future) fencing token is refused
// with a field violation and changes nothing; the real owner's next
// notification still applies.
func TestForgedFenceTokensAreRefused(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	e.send("s1", "m1", "one")

	for _, tok := range []uint64{0, math.MaxUint64} {
		_, err := e.notify.NotifyRouteReady(e.ctx, &sessionv1.NotifyRouteReadyRequest{
			Route: e.route("s1", tok), RuntimeSessionId: "rt-forged", WrapperInstance: "w-forged"})
		apierrtest.RequireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
		fv := apierr.FieldViolations(err)
		require.Len(t, fv, 1)
		require.Equal(t, "route.fence_token", fv[0].GetField())
		_, err = e.notify.NotifyRuntimeEvents(e.ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: e.route("s1", tok)})
		apierrtest.RequireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
	}
	got, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.NotEqual(t, sessionv1.RouteState_ROUTE_STATE_READY, got.GetSession().GetRoute().GetState(), "nothing applied")

	// The real owner (a token from Redis TIME) is still heard: the message is delivered.
	_, err = e.notify.NotifyRouteReady(e.ctx, &sessionv1.NotifyRouteReadyRequest{
		Route: e.route("s1", uint64(e.clock.Now().UnixMicro())), RuntimeSessionId: "rt-s1", WrapperInstance: "w1"})
	require.NoError(t, err)
	e.waitState("s1", "m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
}

// Issue 18 item 6: while Redis is down GetSession and SendMessage answer
// UNAVAILABLE STORE_UNAVAILABLE with RetryInfo, not INTERNAL (WatchSession:
// TestWatchSurfacesRedisOutage).
func TestStoreOutageIsUnavailable(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	require.NoError(t, e.redis.Kill())
	_, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	apierrtest.RequireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	d, ok := apierr.RetryDelay(err)
	require.True(t, ok, "RetryInfo")
	require.Positive(t, d)
	_, err = e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: "m1", Content: "hi"})
	apierrtest.RequireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	e.redis.Start(t)
}

// Issue 18 item 11: a watch cursor older than the trimmed part of the event
// log answers OUT_OF_RANGE CURSOR_EXPIRED with the oldest usable cursor,
// which then resumes without error.
func TestWatchCursorOlderThanTheTrimmedLogIsRefused(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.EventCap = 1000 })
	e.create("s1", "u1", "/work/repo")
	e.emitRuntime("s1", "first")
	s1, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	var old string
	for old == "" {
		resp, err := s1.Recv()
		require.NoError(t, err)
		if resp.GetEvent().GetRuntimeEvent() != nil {
			old = resp.GetEvent().GetCursor()
		}
	}
	// MAXLEN ~ trims whole stream nodes (100 entries): write well past the cap.
	for b := range 14 {
		var evs []*runtimev1.RuntimeEvent
		for i := range 100 {
			id := fmt.Sprint("e", b, "-", i)
			evs = append(evs, &runtimev1.RuntimeEvent{EventId: id, Kind: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_PROGRESS, Text: id})
		}
		_, err := e.notify.NotifyRuntimeEvents(e.ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: e.route("s1", 1), Events: evs})
		require.NoError(t, err)
	}
	w, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1", Cursor: old})
	require.NoError(t, err)
	_, err = w.Recv()
	apierrtest.RequireStatus(t, err, codes.OutOfRange, "CURSOR_EXPIRED")
	oldest := apierr.Info(err).GetMetadata()["oldest_cursor"]
	require.NotEmpty(t, oldest)
	require.Equal(t, "cursor", apierr.FieldViolations(err)[0].GetField())

	w, err = e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1", Cursor: oldest})
	require.NoError(t, err)
	resp, err := w.Recv()
	require.NoError(t, err, "the oldest cursor resumes")
	require.NotNil(t, resp.GetEvent())
}

// Issue 18 item 10: an exhausted wrapper lease after its final observation
// (the sandbox answers lease_state EXHAUSTED, absence not verified) lets
// the deletion complete, per DESIGN.md 3.5; a stop_needed one does not.
func TestExhaustedLeaseAllowsDeletion(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	e.sandbox.inspectionFails.Store(true)
	_, err := e.api.DeleteSession(e.ctx, &sessionv1.DeleteSessionRequest{SessionId: "s1"})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "DELETION_PENDING_CLEANUP")

	e.sandbox.inspectionFails.Store(false)
	e.sandbox.exhaustedLease.Store(true)
	eventually(t, func() bool {
		_, err := e.api.DeleteSession(e.ctx, &sessionv1.DeleteSessionRequest{SessionId: "s1"})
		return err == nil || apierr.Reason(err) == "SESSION_NOT_FOUND"
	}, "deletion completes on the exhausted lease")
	_, err = e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
}
