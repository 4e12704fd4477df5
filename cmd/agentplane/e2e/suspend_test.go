package e2e

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// suspend calls SuspendSession until it answers, honouring the RetryInfo
// of SUSPEND_PENDING; other errors are returned.
func (s *suite) suspend(t testing.TB, id string, force bool) (*sessionv1.Session, error) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := s.ses.SuspendSession(context.Background(), &sessionv1.SuspendSessionRequest{SessionId: id, Force: force})
		if apierr.Reason(err) != "SUSPEND_PENDING" {
			return resp.GetSession(), err
		}
		delay, ok := apierr.RetryDelay(err)
		require.True(t, ok, "SUSPEND_PENDING carries RetryInfo")
		require.True(t, time.Now().Before(deadline), "the suspend was never verified")
		time.Sleep(delay)
	}
}

// filesOfTurn returns the names the list_files of messageID's turn reported.
func filesOfTurn(events []*sessionv1.SessionEvent, messageID string) []string {
	var own []*sessionv1.SessionEvent
	for _, ev := range events {
		if ev.GetRuntimeEvent().GetMessageId() == messageID {
			own = append(own, ev)
		}
	}
	return listedFiles(own)
}

// requireSuspended checks the session's route view says suspended and no
// process of the sandbox (its one runtime key) runs, by a scan of /proc.
func (s *suite) requireSuspended(t *testing.T, sess *sessionv1.Session) {
	t.Helper()
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_SUSPENDED, s.routeView(t, sess.GetSessionId()).GetState())
	require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()), "a suspended session's sandbox runs no process")
}

// TestSuspendAndResume (issue 35, DESIGN.md 3.8): SuspendSession stops the
// session's runtime and returns once no process of it runs (/proc scan);
// the route view and WatchSession say suspended; the next SendMessage
// relaunches the runtime, the turn completes and the file an earlier turn
// wrote in the workspace is still there; ResumeSession relaunches too and
// returns with the route ready. Both calls are idempotent. A turn running
// refuses the suspend (TURN_RUNNING) unless force, which cancels it.
func TestSuspendAndResume(t *testing.T) {
	s := startSuite(t)
	ctx := context.Background()
	sess := s.create(t, "sbx-suspend", "/work/e2e-suspend", newSecret())
	id := sess.GetSessionId()
	s.turn(t, id, "m1", "write: kept.txt survives the suspend")
	require.NotEmpty(t, wrapperPIDs(t, sess.GetSandboxId()), "the runtime runs before the suspend")

	before := s.routeView(t, id).GetRuntimeSessionId()
	t.Run("suspend stops every process and shows suspended", func(t *testing.T) {
		got, err := s.suspend(t, id, false)
		require.NoError(t, err)
		require.Equal(t, sessionv1.RouteState_ROUTE_STATE_SUSPENDED, got.GetRoute().GetState())
		s.requireSuspended(t, sess)

		again, err := s.suspend(t, id, false)
		require.NoError(t, err, "SuspendSession is idempotent")
		require.Equal(t, sessionv1.RouteState_ROUTE_STATE_SUSPENDED, again.GetRoute().GetState())
		s.requireSuspended(t, sess)

		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		stream, err := s.ses.WatchSession(wctx, &sessionv1.WatchSessionRequest{SessionId: id})
		require.NoError(t, err)
		for {
			resp, err := stream.Recv()
			require.NoError(t, err, "WatchSession never showed the suspended route")
			if resp.GetEvent().GetRoute().GetState() == sessionv1.RouteState_ROUTE_STATE_SUSPENDED {
				break
			}
		}
	})

	t.Run("a message resumes and the workspace survived", func(t *testing.T) {
		events := s.turn(t, id, "m2", "after the suspend")
		require.Contains(t, filesOfTurn(events, "m2"), "kept.txt", "the workspace kept the file written before the suspend")
		require.Equal(t, sessionv1.RouteState_ROUTE_STATE_READY, s.routeView(t, id).GetState())
		require.NotEmpty(t, wrapperPIDs(t, sess.GetSandboxId()), "the runtime was relaunched")
		require.Equal(t, before, s.routeView(t, id).GetRuntimeSessionId(), "the resumed route keeps its runtime session")
	})

	t.Run("ResumeSession returns with the route ready, idempotently", func(t *testing.T) {
		_, err := s.suspend(t, id, false)
		require.NoError(t, err)
		s.requireSuspended(t, sess)

		rctx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		resp, err := s.ses.ResumeSession(rctx, &sessionv1.ResumeSessionRequest{SessionId: id})
		require.NoError(t, err)
		require.Equal(t, sessionv1.RouteState_ROUTE_STATE_READY, resp.GetSession().GetRoute().GetState())
		pids := wrapperPIDs(t, sess.GetSandboxId())
		require.NotEmpty(t, pids, "the runtime runs again when ResumeSession returns")

		again, err := s.ses.ResumeSession(rctx, &sessionv1.ResumeSessionRequest{SessionId: id})
		require.NoError(t, err, "ResumeSession is idempotent")
		require.Equal(t, sessionv1.RouteState_ROUTE_STATE_READY, again.GetSession().GetRoute().GetState())
		require.Equal(t, resp.GetSession().GetRoute().GetWrapperInstance(), again.GetSession().GetRoute().GetWrapperInstance(),
			"a second resume of a ready route launches nothing")
		require.Equal(t, pids, wrapperPIDs(t, sess.GetSandboxId()))

		events := s.turn(t, id, "m3", "after ResumeSession")
		require.Contains(t, filesOfTurn(events, "m3"), "kept.txt")
	})

	t.Run("a running turn refuses the suspend unless force", func(t *testing.T) {
		_, err := s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, MessageId: "m4", Content: "slow: until aborted"})
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			m, err := s.ses.GetMessage(ctx, &sessionv1.GetMessageRequest{SessionId: id, MessageId: "m4"})
			return err == nil && m.GetMessage().GetState() == sessionv1.MessageState_MESSAGE_STATE_ACCEPTED
		}, 60*time.Second, 20*time.Millisecond)

		_, err = s.suspend(t, id, false)
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
		require.Equal(t, "TURN_RUNNING", apierr.Reason(err))
		require.NotEmpty(t, wrapperPIDs(t, sess.GetSandboxId()), "a refused suspend stops nothing")
		m, err := s.ses.GetMessage(ctx, &sessionv1.GetMessageRequest{SessionId: id, MessageId: "m4"})
		require.NoError(t, err)
		require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_ACCEPTED, m.GetMessage().GetState(), "a refused suspend cancels nothing")

		got, err := s.suspend(t, id, true)
		require.NoError(t, err)
		require.Equal(t, sessionv1.RouteState_ROUTE_STATE_SUSPENDED, got.GetRoute().GetState())
		s.requireSuspended(t, sess)
		m, err = s.ses.GetMessage(ctx, &sessionv1.GetMessageRequest{SessionId: id, MessageId: "m4"})
		require.NoError(t, err)
		require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_CANCELLED, m.GetMessage().GetState(), "force cancelled the turn")

		events := s.turn(t, id, "m5", "after a forced suspend")
		require.Contains(t, filesOfTurn(events, "m5"), "kept.txt")
		// The log (replayed from its start up to m5's outcome; m4's runtime
		// was verified gone before m5 was sent, so nothing of m4 comes
		// later): m4 ended once, cancelled, and no turn outcome of it says
		// otherwise or comes twice.
		var ends []sessionv1.MessageState
		outcomes := 0
		for _, ev := range events {
			if m := ev.GetMessage(); m.GetMessageId() == "m4" && m.GetState() != sessionv1.MessageState_MESSAGE_STATE_QUEUED &&
				m.GetState() != sessionv1.MessageState_MESSAGE_STATE_ACCEPTED {
				ends = append(ends, m.GetState())
			}
			if o := ev.GetOutcome(); o.GetLastMessageId() == "m4" {
				outcomes++
				require.Equal(t, runtimev1.TurnResult_TURN_RESULT_CANCELLED, o.GetResult(), "m4's outcome %v", o)
			}
		}
		require.Equal(t, []sessionv1.MessageState{sessionv1.MessageState_MESSAGE_STATE_CANCELLED}, ends, "m4 ended exactly once, cancelled")
		require.LessOrEqual(t, outcomes, 1, "at most one outcome of the cancelled turn")
	})

	t.Run("a shared runtime is not suspended", func(t *testing.T) {
		a := s.create(t, "sbx-suspend-shared", "/work/e2e-shared", newSecret())
		b := s.create(t, "sbx-suspend-shared", "/work/e2e-shared", newSecret())
		s.turn(t, a.GetSessionId(), "m1", "first")
		s.turn(t, b.GetSessionId(), "m1", "second")
		before := wrapperPIDs(t, a.GetSandboxId())
		_, err := s.suspend(t, a.GetSessionId(), false)
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
		require.Equal(t, "RUNTIME_SHARED", apierr.Reason(err))
		require.Equal(t, before, wrapperPIDs(t, a.GetSandboxId()), "the sibling's runtime keeps running")
		s.turn(t, b.GetSessionId(), "m2", "still here")
	})

	t.Run("bad input", func(t *testing.T) {
		for _, tc := range []struct {
			name, id string
			code     codes.Code
			reason   string
		}{
			{"unknown session", "ses-does-not-exist", codes.NotFound, "SESSION_NOT_FOUND"},
			{"malformed id", "bad id!", codes.InvalidArgument, "INVALID_REQUEST"},
			{"empty id", "", codes.InvalidArgument, "INVALID_REQUEST"},
		} {
			_, err := s.ses.SuspendSession(ctx, &sessionv1.SuspendSessionRequest{SessionId: tc.id})
			require.Equal(t, tc.code, status.Code(err), "SuspendSession %s: %v", tc.name, err)
			require.Equal(t, tc.reason, apierr.Reason(err), "SuspendSession %s", tc.name)
			_, err = s.ses.ResumeSession(ctx, &sessionv1.ResumeSessionRequest{SessionId: tc.id})
			require.Equal(t, tc.code, status.Code(err), "ResumeSession %s: %v", tc.name, err)
			require.Equal(t, tc.reason, apierr.Reason(err), "ResumeSession %s", tc.name)
		}

		s.deleteSession(t, id)
		require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()))
		for _, call := range []func() error{
			func() error { _, err := s.suspend(t, id, true); return err },
			func() error {
				_, err := s.ses.ResumeSession(ctx, &sessionv1.ResumeSessionRequest{SessionId: id})
				return err
			},
		} {
			err := call()
			require.Equal(t, codes.NotFound, status.Code(err), "a deleted session: %v", err)
			require.Equal(t, "SESSION_NOT_FOUND", apierr.Reason(err))
		}
		require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()), "neither call launched anything")
	})
}

// TestIdleSessionSuspendsAfterSuspendAfter (issue 35 item 1, DESIGN.md
// 3.8): a session created with suspend_after 2 s is suspended by the
// session service's sweeper once its turn ended and nothing came for that
// long: in its event log the suspended route comes after the turn's
// outcome, the route view says suspended and no process of its sandbox
// runs (/proc scan); the next SendMessage resumes it and its turn
// completes, and the workspace kept the earlier turn's file. A bad
// suspend_after is refused with a field violation.
func TestIdleSessionSuspendsAfterSuspendAfter(t *testing.T) {
	st := newStack(t, stackOptions{})
	st.set(svcSession, "SESSION_SWEEP_INTERVAL", "200ms")
	logs := captureStderr(t)
	stopped := st.runInProcess(nil)
	s := st.suite()
	s.logs, s.stopped = logs, stopped
	ctx := context.Background()

	create := func(after *durationpb.Duration) (*sessionv1.Session, error) {
		resp, err := s.ses.CreateSession(ctx, &sessionv1.CreateSessionRequest{
			UserId: "u-e2e", OrgId: "o-e2e", SandboxId: "sbx-autosuspend-" + s.run,
			Worktree:     &sessionv1.Worktree{Directory: "/work/e2e-autosuspend"},
			Credential:   &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
			SuspendAfter: after,
		})
		return resp.GetSession(), err
	}
	var sess *sessionv1.Session
	require.Eventually(t, func() bool {
		var err error
		sess, err = create(durationpb.New(2 * time.Second))
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 2*time.Second, sess.GetSuspendAfter().AsDuration(), "the session shows its suspend_after")
	id := sess.GetSessionId()

	s.turn(t, id, "m1", "write: kept.txt survives the idle suspend")
	// Only stops a hung test: the sweeper suspends 2 s after the outcome.
	require.Eventually(t, func() bool {
		return s.routeView(t, id).GetState() == sessionv1.RouteState_ROUTE_STATE_SUSPENDED
	}, 90*time.Second, 50*time.Millisecond, "the idle session was never suspended")
	s.requireSuspended(t, sess)

	// The log: m1's outcome, then the suspended route, nothing in between
	// that started another turn.
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	stream, err := s.ses.WatchSession(wctx, &sessionv1.WatchSessionRequest{SessionId: id})
	require.NoError(t, err)
	outcome := false
	for {
		resp, err := stream.Recv()
		require.NoError(t, err, "WatchSession never showed the suspended route")
		ev := resp.GetEvent()
		if ev.GetOutcome().GetLastMessageId() == "m1" {
			outcome = true
		}
		if ev.GetRoute().GetState() == sessionv1.RouteState_ROUTE_STATE_SUSPENDED {
			require.True(t, outcome, "suspended only after m1's turn ended")
			break
		}
	}
	cancel()

	events := s.turn(t, id, "m2", "after the idle suspend")
	require.Contains(t, filesOfTurn(events, "m2"), "kept.txt", "the workspace kept the file written before the suspend")
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_READY, s.routeView(t, id).GetState())
	require.NotEmpty(t, wrapperPIDs(t, sess.GetSandboxId()), "the message relaunched the runtime")

	for _, bad := range []*durationpb.Duration{durationpb.New(-time.Second), durationpb.New(10 * time.Millisecond), durationpb.New(31 * 24 * time.Hour)} {
		_, err := create(bad)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "suspend_after %s: %v", bad.AsDuration(), err)
		require.Equal(t, "INVALID_REQUEST", apierr.Reason(err))
		vs := apierr.FieldViolations(err)
		require.Len(t, vs, 1, "%v", err)
		require.Equal(t, "suspend_after", vs[0].GetField())
	}
	s.deleteSession(t, id)
	require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()))
}

// TestResumeWithLostStateFailsUntilRestart (issue 35, "Faults and bad
// input"): a suspended session whose workspace and runtime home are gone
// (a disk lost) is never resumed as an agent that forgot the conversation:
// the next message fails with the route failed resume_state_lost and
// nothing is launched, ResumeSession answers FAILED_PRECONDITION
// ROUTE_FAILED with that reason, and ResumeSession{restart: true} continues
// with a new conversation (a new runtime session id, an empty workspace);
// the export keeps the first conversation's turn before the new one's.
func TestResumeWithLostStateFailsUntilRestart(t *testing.T) {
	s := startSuite(t)
	ctx := context.Background()
	sess := s.create(t, "sbx-lost", "/work/e2e-lost", newSecret())
	id := sess.GetSessionId()
	s.turn(t, id, "m1", "write: kept.txt before the loss")
	before := s.routeView(t, id).GetRuntimeSessionId()
	_, err := s.suspend(t, id, false)
	require.NoError(t, err)
	s.requireSuspended(t, sess)

	// The disk is lost: every workspace and home of the sandbox goes.
	for _, sub := range []string{"workspaces", "homes"} {
		dir := filepath.Join(s.root, sess.GetSandboxId(), sub)
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.NotEmpty(t, entries, "%s held the session's state", sub)
		for _, e := range entries {
			require.NoError(t, os.RemoveAll(filepath.Join(dir, e.Name())))
		}
	}

	_, err = s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, MessageId: "m2", Content: "after the loss"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		m, err := s.ses.GetMessage(ctx, &sessionv1.GetMessageRequest{SessionId: id, MessageId: "m2"})
		require.NoError(t, err)
		return m.GetMessage().GetState() == sessionv1.MessageState_MESSAGE_STATE_FAILED
	}, 90*time.Second, 50*time.Millisecond, "the message after the loss fails")
	v := s.routeView(t, id)
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_FAILED, v.GetState())
	require.Equal(t, "resume_state_lost", v.GetFailureReason())
	require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()), "nothing was launched")

	rctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	_, err = s.ses.ResumeSession(rctx, &sessionv1.ResumeSessionRequest{SessionId: id})
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "%v", err)
	require.Equal(t, "ROUTE_FAILED", apierr.Reason(err))
	require.Equal(t, "resume_state_lost", apierr.Info(err).GetMetadata()["failure_reason"])
	require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()), "a resume without restart launches nothing")

	resp, err := s.ses.ResumeSession(rctx, &sessionv1.ResumeSessionRequest{SessionId: id, Restart: true})
	require.NoError(t, err)
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_READY, resp.GetSession().GetRoute().GetState())
	after := resp.GetSession().GetRoute().GetRuntimeSessionId()
	require.NotEmpty(t, after)
	require.NotEqual(t, before, after, "a new conversation, under a new runtime session")

	events := s.turn(t, id, "m3", "the new conversation")
	require.NotContains(t, filesOfTurn(events, "m3"), "kept.txt", "the workspace started empty")
	require.Equal(t, after, s.routeView(t, id).GetRuntimeSessionId())

	require.Eventually(t, func() bool {
		var order []string
		var all strings.Builder
		r, err := s.ses.ExportHistory(ctx, &sessionv1.ExportHistoryRequest{SessionId: id})
		require.NoError(t, err)
		for _, it := range r.GetItems() {
			if len(order) == 0 || order[len(order)-1] != it.GetRuntimeSessionId() {
				order = append(order, it.GetRuntimeSessionId())
			}
			all.Write(it.GetItem().GetPayload())
		}
		a, b := strings.Index(all.String(), "kept.txt before the loss"), strings.Index(all.String(), "the new conversation")
		return a >= 0 && b > a && slices.Equal(order, []string{before, after})
	}, time.Minute, 200*time.Millisecond, "the export holds the lost conversation's turn, then the new one's")

	s.deleteSession(t, id)
	require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()))
}
