package server

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
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
		requireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
		fv := apierr.FieldViolations(err)
		require.Len(t, fv, 1)
		require.Equal(t, "route.fence_token", fv[0].GetField())
		_, err = e.notify.NotifyRuntimeEvents(e.ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: e.route("s1", tok)})
		requireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
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
	requireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	d, ok := apierr.RetryDelay(err)
	require.True(t, ok, "RetryInfo")
	require.Positive(t, d)
	_, err = e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: "m1", Content: "hi"})
	requireStatus(t, err, codes.Unavailable, apierr.ReasonStoreUnavailable)
	e.redis.Start(t)
}
