package service

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testclock"
	"agentplane.dev/services/session/internal/session"
)

// lostStateSandbox answers a plain Prepare with the route failed
// resume_state_lost (its workspace is gone) and a restart with a ready
// route under a new runtime session; it records each restart flag.
type lostStateSandbox struct {
	suspendingSandbox
	mu       sync.Mutex
	restarts []bool
}

func (s *lostStateSandbox) Prepare(_ context.Context, sess *session.Session, restart bool) (session.RouteView, error) {
	s.mu.Lock()
	s.restarts = append(s.restarts, restart)
	s.mu.Unlock()
	if restart {
		return session.RouteView{State: session.RouteReady, RuntimeSessionID: "rs2", WrapperInstance: "w2", SandboxID: sess.SandboxID}, nil
	}
	return session.RouteView{State: session.RouteFailed, FailureReason: session.ReasonResumeStateLost, SandboxID: sess.SandboxID}, nil
}

func (s *lostStateSandbox) calls() []bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]bool(nil), s.restarts...)
}

// A suspended session whose state is lost: ResumeSession fails
// ROUTE_FAILED resume_state_lost and never asks for a restart on its own;
// with restart it asks once, after the plain resume failed so, and returns
// the ready route under its new runtime session.
func TestResumeRestartsOnlyWhenAsked(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t).Client(t)
	sbx := &lostStateSandbox{}
	a := suspendReplica(t, rdb, sbx, testclock.New(time.Now()))
	sess, err := a.Create(ctx, CreateInput{ID: "s1", UserID: "u1", OrgID: "o1", Directory: "/w", Class: session.CredentialStatic, Secret: "x"})
	require.NoError(t, err)
	n := session.Notice{SandboxID: sess.SandboxID, FenceToken: 1}
	require.NoError(t, a.RouteReady(ctx, "s1", n, "rs1", "w1"))
	_, err = a.Suspend(ctx, "s1", false)
	require.NoError(t, err)

	_, err = a.Resume(ctx, "s1", false)
	var failed *session.RouteFailedError
	require.ErrorAs(t, err, &failed)
	require.Equal(t, session.ReasonResumeStateLost, failed.Reason)
	require.Equal(t, []bool{false}, sbx.calls(), "no restart unless asked")

	got, err := a.Resume(ctx, "s1", true)
	require.NoError(t, err)
	require.Equal(t, session.RouteReady, got.Route.State)
	require.Equal(t, "rs2", got.Route.RuntimeSessionID)
	require.Equal(t, []bool{false, true}, sbx.calls(), "the failed route is prepared once with restart")

	_, err = a.Resume(ctx, "s1", true)
	require.NoError(t, err)
	require.Len(t, sbx.calls(), 2, "a ready route is returned as it is, whatever restart says")

	// Suspended again and lost again: restart tries the plain resume first.
	_, err = a.Suspend(ctx, "s1", false)
	require.NoError(t, err)
	got, err = a.Resume(ctx, "s1", true)
	require.NoError(t, err)
	require.Equal(t, session.RouteReady, got.Route.State)
	require.Equal(t, []bool{false, true, false, true}, sbx.calls())
}
