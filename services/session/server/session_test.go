package server

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/apierr/apierrtest"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/session/internal/session"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// grpc-go's and go-redis' process-wide background workers.
		goleak.IgnoreTopFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"),
		// go-redis redials a dead node (the killed Cluster master) once a
		// second; a closed pool's redialer ends when its sleep does.
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
	)
}

func TestSendMessageIsIdempotentOnMessageID(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	first := e.send("s1", "m1", "hello")
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_QUEUED, first.GetState())
	require.Equal(t, uint64(1), first.GetSequence())

	again := e.send("s1", "m1", "hello")
	require.Equal(t, first.GetSequence(), again.GetSequence())
	require.Equal(t, "hello", again.GetContent())
	require.True(t, first.GetCreateTime().AsTime().Equal(again.GetCreateTime().AsTime()))

	_, err := e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: "m1", Content: "other"})
	apierrtest.RequireStatus(t, err, codes.AlreadyExists, "MESSAGE_ID_CONFLICT")

	list, err := e.api.ListMessages(e.ctx, &sessionv1.ListMessagesRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Len(t, list.GetMessages(), 1, "the retry stored nothing new")
}

func TestCreateSessionKeepsOnlyACredentialReference(t *testing.T) {
	e := newEnv(t)
	s := e.create("s1", "u1", "/work/repo")
	require.Equal(t, sessionv1.SessionState_SESSION_STATE_ACTIVE, s.GetState())
	require.True(t, strings.HasPrefix(s.GetSandboxId(), "sbx-"))
	secret, ok := e.creds.secret("cref-s1")
	require.True(t, ok)
	require.Equal(t, "sk-SECRET-s1", secret)

	// Same request again: the same session; another secret: a conflict.
	again := e.create("s1", "u1", "/work/repo")
	require.Equal(t, s.GetCreateTime().AsTime(), again.GetCreateTime().AsTime())
	_, err := e.api.CreateSession(e.ctx, &sessionv1.CreateSessionRequest{
		SessionId: "s1", UserId: "u1", OrgId: "org1",
		Worktree:   &sessionv1.Worktree{Directory: "/work/repo", RepoUrl: "https://example.com/r.git"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "other"},
	})
	apierrtest.RequireStatus(t, err, codes.AlreadyExists, "SESSION_ID_CONFLICT")

	// Same user, another directory: the same derived sandbox.
	other := e.create("s2", "u1", "/work/other")
	require.Equal(t, s.GetSandboxId(), other.GetSandboxId())
	require.NotEqual(t, s.GetSandboxId(), e.create("s3", "u2", "/work/repo").GetSandboxId())

	// The secret is in no Redis value of the session service and no log line.
	keys, err := e.rdb.Keys(e.ctx, "ses:*").Result()
	require.NoError(t, err)
	for _, k := range keys {
		if typ := e.rdb.Type(e.ctx, k).Val(); typ == "string" {
			require.NotContains(t, e.rdb.Get(e.ctx, k).Val(), "sk-SECRET")
		}
	}
	require.NotContains(t, e.logs.String(), "sk-SECRET")
}

func TestMessageFlowFromPrepareToCompleted(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	stream, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)

	e.send("s1", "m1", "first")
	e.send("s1", "m2", "second")
	eventually(t, func() bool { return e.sandbox.count(e.sandbox.prepares, "s1") > 0 }, "prepare")
	_, err = e.notify.NotifyRouteProgress(e.ctx, &sessionv1.NotifyRouteProgressRequest{
		Route: e.route("s1", 1), Progress: &runtimev1.ProgressStep{Step: "launch_wrapper"}})
	require.NoError(t, err)
	e.ready("s1", "w1")
	e.waitState("s1", "m2", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	require.Equal(t, []string{"m1", "m2"}, e.sandbox.deliveredTo("s1"), "delivered once, in order")

	ev := &runtimev1.RuntimeEvent{EventId: "e1", RuntimeSessionId: "rt-s1", MessageId: "m2",
		Kind: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE, Text: "done"}
	for range 2 { // a repeated event id is dropped
		_, err = e.notify.NotifyRuntimeEvents(e.ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: e.route("s1", 1), Events: []*runtimev1.RuntimeEvent{ev}})
		require.NoError(t, err)
	}
	out := &runtimev1.TurnOutcome{TurnId: "t1", RuntimeSessionId: "rt-s1", LastMessageId: "m2", Result: runtimev1.TurnResult_TURN_RESULT_SUCCEEDED}
	_, err = e.notify.NotifyTurnOutcome(e.ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: e.route("s1", 1), Outcome: out})
	require.NoError(t, err)
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_COMPLETED, e.message("s1", "m1").GetState())
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_COMPLETED, e.message("s1", "m2").GetState())

	// A late failed outcome for terminal messages changes nothing.
	late := &runtimev1.TurnOutcome{TurnId: "t2", LastMessageId: "m2", Result: runtimev1.TurnResult_TURN_RESULT_FAILED}
	_, err = e.notify.NotifyTurnOutcome(e.ctx, &sessionv1.NotifyTurnOutcomeRequest{Route: e.route("s1", 1), Outcome: late})
	require.NoError(t, err)
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_COMPLETED, e.message("s1", "m2").GetState())

	var kinds []string
	runtimeEvents, outcomes := 0, 0
	for outcomes < 2 {
		resp, err := stream.Recv()
		require.NoError(t, err)
		switch k := resp.GetEvent().GetKind().(type) {
		case *sessionv1.SessionEvent_RuntimeEvent:
			runtimeEvents++
			require.Equal(t, "done", k.RuntimeEvent.GetText())
		case *sessionv1.SessionEvent_Outcome:
			outcomes++
		case *sessionv1.SessionEvent_Progress:
			kinds = append(kinds, "progress:"+k.Progress.GetStep())
		case *sessionv1.SessionEvent_Message:
			kinds = append(kinds, k.Message.GetMessageId()+":"+k.Message.GetState().String())
		}
	}
	require.Equal(t, 1, runtimeEvents)
	require.Contains(t, kinds, "progress:launch_wrapper")
	require.Contains(t, kinds, "m2:MESSAGE_STATE_ACCEPTED")
	require.Contains(t, kinds, "m2:MESSAGE_STATE_COMPLETED")
}

func TestWatchSessionResumesFromCursorWithoutLossOrRepeat(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	emit := func(from, to int) {
		for i := from; i < to; i++ {
			_, err := e.notify.NotifyRuntimeEvents(e.ctx, &sessionv1.NotifyRuntimeEventsRequest{Route: e.route("s1", 1),
				Events: []*runtimev1.RuntimeEvent{{EventId: fmt.Sprint("e", i), Kind: runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_PROGRESS, Text: fmt.Sprint(i)}}})
			require.NoError(t, err)
		}
	}
	recvRuntime := func(s sessionv1.SessionService_WatchSessionClient, n int) (texts []string, last string) {
		for len(texts) < n {
			resp, err := s.Recv()
			require.NoError(t, err)
			last = resp.GetEvent().GetCursor()
			if ev := resp.GetEvent().GetRuntimeEvent(); ev != nil {
				texts = append(texts, ev.GetText())
			}
		}
		return texts, last
	}
	emit(0, 300) // more than one replay batch
	ctx, cancel := context.WithCancel(e.ctx)
	s1, err := e.api.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	got, cursor := recvRuntime(s1, 150)
	cancel() // the client disconnects mid-log
	for err == nil {
		_, err = s1.Recv()
	}
	require.Equal(t, codes.Canceled, status.Code(err))

	emit(300, 400) // written while nobody watches
	s2, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1", Cursor: cursor})
	require.NoError(t, err)
	rest, _ := recvRuntime(s2, 250)
	got = append(got, rest...)
	emitted := make(chan struct{})
	go func() { defer close(emitted); emit(400, 450) }() // live events after the replay
	live, _ := recvRuntime(s2, 50)
	<-emitted
	got = append(got, live...)
	require.Len(t, got, 450)
	for i, text := range got {
		require.Equal(t, fmt.Sprint(i), text, "event %d lost, repeated or out of order", i)
	}

	// "$" starts with new events only: keep emitting until the watcher sees one.
	s3, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1", Cursor: "$"})
	require.NoError(t, err)
	emitted2 := make(chan struct{})
	stop := make(chan struct{})
	go func() {
		defer close(emitted2)
		for i := 450; ; i++ {
			select {
			case <-stop:
				return
			default:
				emit(i, i+1)
			}
		}
	}()
	first, _ := recvRuntime(s3, 1)
	close(stop)
	<-emitted2
	require.NotContains(t, got, first[0], "an old event was replayed after \"$\"")
}

func TestDeletionWaitsForVerifiedAbsenceThenReconcilerFinishes(t *testing.T) {
	e := newEnv(t, fastReconcile)
	e.create("s1", "u1", "/work/repo")
	e.send("s1", "m1", "hi")
	e.ready("s1", "w1")
	e.waitState("s1", "m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)

	e.sandbox.inspectionFails.Store(true)
	_, err := e.api.DeleteSession(e.ctx, &sessionv1.DeleteSessionRequest{SessionId: "s1"})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "DELETION_PENDING_CLEANUP")
	delay, ok := apierr.RetryDelay(err)
	require.True(t, ok, "RetryInfo attached")
	require.Positive(t, delay)

	// The intent stays and the session takes no work while absence is unknown.
	got, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Equal(t, sessionv1.SessionState_SESSION_STATE_DELETING, got.GetSession().GetState())
	_, err = e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: "m2", Content: "x"})
	apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
	// The fake clock moves so persisted backoffs come due; no client call.
	eventually(t, func() bool {
		e.clock.Add(100 * time.Millisecond)
		return e.sandbox.count(e.sandbox.releases, "s1") >= 3
	}, "reconciler retries the release")
	require.Equal(t, int64(1), e.rdb.Exists(e.ctx, "ses:{ses/s1}:del").Val(), "intent kept")
	require.Equal(t, int64(1), e.rdb.Exists(e.ctx, "ses:{ses/s1}:meta").Val())
	_, kept := e.creds.secret("cref-s1")
	require.True(t, kept, "the backing credential is deleted only after verified absence")

	// Inspection recovers: the reconciler finishes with no further client call.
	e.sandbox.inspectionFails.Store(false)
	eventually(t, func() bool {
		e.clock.Add(100 * time.Millisecond)
		_, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
		return status.Code(err) == codes.NotFound
	}, "deletion completed")
	_, stillThere := e.creds.secret("cref-s1")
	require.False(t, stillThere, "backing credential deleted")
	require.True(t, e.ingest.wasDeleted("rt-s1"))
	keys, err := e.rdb.Keys(e.ctx, "ses:{ses/s1}:*").Result()
	require.NoError(t, err)
	require.Empty(t, keys)
	loc := e.rdb.HGetAll(e.ctx, "ses:wipe:{ses/s1}").Val()
	require.Equal(t, "/work/repo", loc["directory"])
	require.NotEmpty(t, loc["sandbox_id"])
	for _, idx := range []string{"ses:idx:org:org1", "ses:idx:user:org1:u1"} {
		require.Zero(t, e.rdb.ZCard(e.ctx, idx).Val(), idx)
	}
	_, err = e.api.DeleteSession(e.ctx, &sessionv1.DeleteSessionRequest{SessionId: "s1"})
	apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
}

func TestDeleteSucceedsAtOnceWhenAbsenceIsVerified(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	_, err := e.api.DeleteSession(e.ctx, &sessionv1.DeleteSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	_, err = e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
	stream, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	_, err = stream.Recv()
	apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
}

// A queued message whose drain ended without delivering it (the replica
// that queued it died, or gave up on an unavailable sandbox service) is
// drained again by the sweep once it is queued longer than
// SESSION_QUEUED_REDRIVE, not left for the 16.5-minute backstop.
func TestSweepRedrivesAStalledQueuedMessage(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	e.sandbox.readyOnPrepare.Store(true)
	e.sandbox.prepareUnavailable.Store(true)
	e.send("s1", "q1", "stalled")
	prepares := func() int {
		e.sandbox.mu.Lock()
		defer e.sandbox.mu.Unlock()
		return e.sandbox.prepares["s1"]
	}
	require.Eventually(t, func() bool { return prepares() == 8 }, 60*time.Second, 20*time.Millisecond, "the drain tries 8 times, then gives up")
	e.sandbox.prepareUnavailable.Store(false)

	e.svc.Sweep(context.Background()) // not yet stalled: no drain
	require.Equal(t, 8, prepares())
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_QUEUED, e.message("s1", "q1").GetState())

	e.clock.Add(DefaultConfig().QueuedRedrive + time.Second)
	e.svc.Sweep(context.Background())
	e.waitState("s1", "q1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	require.Greater(t, prepares(), 8)
}

func TestBackstopsFailStuckMessages(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	e.create("s2", "u1", "/work/repo2")
	e.send("s1", "q1", "never prepared")
	e.send("s2", "a1", "never answered")
	e.ready("s2", "w1")
	e.waitState("s2", "a1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)

	e.clock.Add(16 * time.Minute)
	e.svc.Sweep(context.Background())
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_QUEUED, e.message("s1", "q1").GetState())

	e.clock.Add(31 * time.Second) // queued 16.5 min + 1 s
	e.svc.Sweep(context.Background())
	q := e.message("s1", "q1")
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_FAILED, q.GetState())
	require.Equal(t, "preparation_timeout", q.GetFailureReason())
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_ACCEPTED, e.message("s2", "a1").GetState())

	e.clock.Add(125*time.Minute - 16*time.Minute) // accepted 125 min + 1 s
	e.svc.Sweep(context.Background())
	a := e.message("s2", "a1")
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_FAILED, a.GetState())
	require.Equal(t, "no_outcome", a.GetFailureReason())
}

func TestRouteRules(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	e.send("s1", "m1", "one")
	e.ready("s1", "w1")
	e.waitState("s1", "m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)

	// A restarted wrapper fails the old accepted work.
	e.ready("s1", "w2")
	m1 := e.message("s1", "m1")
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_FAILED, m1.GetState())
	require.Equal(t, "agent_restarted", m1.GetFailureReason())

	// Lost: accepted work fails, queued work is prepared again.
	e.send("s1", "m2", "two")
	e.waitState("s1", "m2", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	e.sandbox.deliverNotReady.Store(true)
	_, err := e.notify.NotifyRouteReconnecting(e.ctx, &sessionv1.NotifyRouteReconnectingRequest{Route: e.route("s1", 1)})
	require.NoError(t, err)
	e.send("s1", "m3", "three")
	preparesBefore := e.sandbox.count(e.sandbox.prepares, "s1")
	_, err = e.notify.NotifyRouteLost(e.ctx, &sessionv1.NotifyRouteLostRequest{Route: e.route("s1", 1), Reason: "heartbeat_lost"})
	require.NoError(t, err)
	m2 := e.message("s1", "m2")
	require.Equal(t, "route_lost", m2.GetFailureReason())
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_QUEUED, e.message("s1", "m3").GetState())
	eventually(t, func() bool { return e.sandbox.count(e.sandbox.prepares, "s1") > preparesBefore }, "re-prepare after lost")

	// A notification from a deposed sandbox owner (older token) is dropped.
	_, err = e.notify.NotifyRouteFailed(e.ctx, &sessionv1.NotifyRouteFailedRequest{Route: &sessionv1.RouteRef{SessionId: "s1", FenceToken: 5}, Reason: "x"})
	require.NoError(t, err)
	e.send("s1", "m4", "four")
	_, err = e.notify.NotifyRouteFailed(e.ctx, &sessionv1.NotifyRouteFailedRequest{Route: &sessionv1.RouteRef{SessionId: "s1", FenceToken: 4}, Reason: "stale"})
	require.NoError(t, err)
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_QUEUED, e.message("s1", "m4").GetState())

	// Failed: queued and accepted work fails.
	_, err = e.notify.NotifyRouteFailed(e.ctx, &sessionv1.NotifyRouteFailedRequest{Route: &sessionv1.RouteRef{SessionId: "s1", FenceToken: 6}, Reason: "capacity_rejected"})
	require.NoError(t, err)
	m4 := e.message("s1", "m4")
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_FAILED, m4.GetState())
	require.Equal(t, "route_failed", m4.GetFailureReason())
	got, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_FAILED, got.GetSession().GetRoute().GetState())
	require.Equal(t, "capacity_rejected", got.GetSession().GetRoute().GetFailureReason())

	// Notifications for unknown sessions are acknowledged and dropped.
	_, err = e.notify.NotifyRouteReady(e.ctx, &sessionv1.NotifyRouteReadyRequest{Route: e.route("nope", 1)})
	require.NoError(t, err)
}

func TestStopAndCancel(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	e.send("s1", "m1", "one")
	e.ready("s1", "w1")
	e.waitState("s1", "m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	e.sandbox.deliverNotReady.Store(true)
	e.send("s1", "m2", "two")

	c, err := e.api.CancelMessage(e.ctx, &sessionv1.CancelMessageRequest{SessionId: "s1", MessageId: "m2"})
	require.NoError(t, err)
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_CANCELLED, c.GetMessage().GetState())
	_, err = e.api.CancelMessage(e.ctx, &sessionv1.CancelMessageRequest{SessionId: "s1", MessageId: "zz"})
	apierrtest.RequireStatus(t, err, codes.NotFound, "MESSAGE_NOT_FOUND")

	st, err := e.api.StopSession(e.ctx, &sessionv1.StopSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Equal(t, sessionv1.SessionState_SESSION_STATE_STOPPED, st.GetSession().GetState())
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_CANCELLED, e.message("s1", "m1").GetState())
	require.Equal(t, 1, e.sandbox.count(e.sandbox.aborts, "s1"), "best-effort abort for the running turn")

	e.send("s1", "m3", "again")
	got, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Equal(t, sessionv1.SessionState_SESSION_STATE_ACTIVE, got.GetSession().GetState())
}

func TestRetentionDeletesIdleSessions(t *testing.T) {
	e := newEnv(t)
	e.create("old", "u1", "/work/a")
	e.clock.Add(60 * 24 * time.Hour)
	e.create("young", "u1", "/work/b")
	e.clock.Add(31 * 24 * time.Hour)
	e.svc.Sweep(context.Background())
	_, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "old"})
	apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
	_, err = e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "young"})
	require.NoError(t, err)
	require.True(t, e.sandbox.released["old"])
}

func TestListSessionsPages(t *testing.T) {
	e := newEnv(t)
	for i := range 7 {
		e.create(fmt.Sprint("s", i), "u1", fmt.Sprint("/work/", i))
		e.clock.Add(time.Second)
	}
	e.create("other", "u2", "/work/x")
	var ids []string
	token := ""
	for {
		resp, err := e.api.ListSessions(e.ctx, &sessionv1.ListSessionsRequest{OrgId: "org1", UserId: "u1", PageSize: 3, PageToken: token})
		require.NoError(t, err)
		for _, s := range resp.GetSessions() {
			ids = append(ids, s.GetSessionId())
		}
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	require.Equal(t, []string{"s6", "s5", "s4", "s3", "s2", "s1", "s0"}, ids, "newest first, each once")
	all, err := e.api.ListSessions(e.ctx, &sessionv1.ListSessionsRequest{OrgId: "org1"})
	require.NoError(t, err)
	require.Len(t, all.GetSessions(), 8)
}

func TestBadInput(t *testing.T) {
	e := newEnv(t)
	e.create("s1", "u1", "/work/repo")
	create := func(mut func(*sessionv1.CreateSessionRequest)) error {
		r := &sessionv1.CreateSessionRequest{UserId: "u1", OrgId: "o1", Worktree: &sessionv1.Worktree{Directory: "/w"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-SECRET-x"}}
		mut(r)
		_, err := e.api.CreateSession(e.ctx, r)
		return err
	}
	cases := []struct {
		name  string
		call  func() error
		code  codes.Code
		field string
	}{
		{"dotdot directory", func() error {
			return create(func(r *sessionv1.CreateSessionRequest) { r.Worktree.Directory = "/work/../etc" })
		}, codes.InvalidArgument, "worktree.directory"},
		{"relative directory", func() error {
			return create(func(r *sessionv1.CreateSessionRequest) { r.Worktree.Directory = "work/repo" })
		}, codes.InvalidArgument, "worktree.directory"},
		{"control char directory", func() error {
			return create(func(r *sessionv1.CreateSessionRequest) { r.Worktree.Directory = "/work/\x07repo" })
		}, codes.InvalidArgument, "worktree.directory"},
		{"double slash directory", func() error {
			return create(func(r *sessionv1.CreateSessionRequest) { r.Worktree.Directory = "/work//repo" })
		}, codes.InvalidArgument, "worktree.directory"},
		{"malformed session id", func() error {
			return create(func(r *sessionv1.CreateSessionRequest) { r.SessionId = "a/b" })
		}, codes.InvalidArgument, "session_id"},
		{"missing class", func() error {
			return create(func(r *sessionv1.CreateSessionRequest) { r.Credential.Class = 0 })
		}, codes.InvalidArgument, "credential.class"},
		{"oversize content", func() error {
			_, err := e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: "m", Content: strings.Repeat("x", 256<<10+1)})
			return err
		}, codes.InvalidArgument, "content"},
		{"empty content", func() error {
			_, err := e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: "m"})
			return err
		}, codes.InvalidArgument, "content"},
		{"malformed message id", func() error {
			_, err := e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: strings.Repeat("m", 65), Content: "x"})
			return err
		}, codes.InvalidArgument, "message_id"},
		{"unknown session", func() error {
			_, err := e.api.SendMessage(e.ctx, &sessionv1.SendMessageRequest{SessionId: "nope", MessageId: "m", Content: "x"})
			return err
		}, codes.NotFound, "session_id"},
		{"unknown message", func() error {
			_, err := e.api.GetMessage(e.ctx, &sessionv1.GetMessageRequest{SessionId: "s1", MessageId: "nope"})
			return err
		}, codes.NotFound, "message_id"},
		{"malformed session id on get", func() error {
			_, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: "s 1"})
			return err
		}, codes.InvalidArgument, "session_id"},
		{"bad page token", func() error {
			_, err := e.api.ListSessions(e.ctx, &sessionv1.ListSessionsRequest{OrgId: "org1", PageToken: "!!"})
			return err
		}, codes.InvalidArgument, "page_token"},
		{"bad page size", func() error {
			_, err := e.api.ListMessages(e.ctx, &sessionv1.ListMessagesRequest{SessionId: "s1", PageSize: 501})
			return err
		}, codes.InvalidArgument, "page_size"},
		{"bad cursor", func() error {
			s, err := e.api.WatchSession(e.ctx, &sessionv1.WatchSessionRequest{SessionId: "s1", Cursor: "x-1"})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		}, codes.InvalidArgument, "cursor"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			require.Equal(t, c.code, status.Code(err), "%v", err)
			require.NotEmpty(t, apierr.Reason(err))
			var fields []string
			for _, v := range apierr.FieldViolations(err) {
				fields = append(fields, v.GetField())
			}
			require.Contains(t, fields, c.field)
		})
	}
	list, err := e.api.ListMessages(e.ctx, &sessionv1.ListMessagesRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Empty(t, list.GetMessages(), "nothing half-applied")
	require.NotContains(t, e.logs.String(), "sk-SECRET")
}

var _ = io.EOF

// Concurrent sends to one ready session: every message goes out exactly once
// and in queue order, although a drain may start from the state SendMessage
// just committed instead of reading the session again (a stale start would
// deliver an already accepted message a second time).
func TestConcurrentSendsAreDeliveredOnceInOrder(t *testing.T) {
	e := newEnv(t)
	e.sandbox.readyOnPrepare.Store(true)
	e.create("s1", "u1", "/work/repo")
	e.ready("s1", "w1")
	const clients, each = 8, 40
	seqs := make(chan [2]any, clients*each)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				m := e.send("s1", fmt.Sprintf("m%d-%d", c, i), "go")
				seqs <- [2]any{m.GetMessageId(), m.GetSequence()}
			}
		})
	}
	wg.Wait()
	close(seqs)
	bySeq := map[uint64]string{}
	for p := range seqs {
		bySeq[p[1].(uint64)] = p[0].(string)
	}
	want := make([]string, 0, clients*each)
	for s := uint64(1); s <= clients*each; s++ {
		want = append(want, bySeq[s])
	}
	eventually(t, func() bool { return len(e.sandbox.deliveredTo("s1")) >= len(want) }, "all delivered")
	for _, id := range want {
		e.waitState("s1", id, sessionv1.MessageState_MESSAGE_STATE_ACCEPTED)
	}
	require.Equal(t, want, e.sandbox.deliveredTo("s1"), "each message delivered once, in queue order")
}

// A session may name only a sandbox of its own tenant: another tenant's
// (bound at its CreateSession), and another tenant's default sandbox id,
// which anyone can compute, are refused at CreateSession with nothing
// stored, the same answer either way.
func TestCreateSessionRefusesAnotherTenantsSandbox(t *testing.T) {
	e := newEnv(t)
	alice := e.create("s-alice", "alice", "/work/repo") // org1/alice's default sandbox
	create := func(id, sandbox string) error {
		_, err := e.api.CreateSession(e.ctx, &sessionv1.CreateSessionRequest{
			SessionId: id, UserId: "mallory", OrgId: "orgEvil", SandboxId: sandbox,
			Worktree:   &sessionv1.Worktree{Directory: "/work/repo"},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-evil"},
		})
		return err
	}
	apierrtest.RequireStatus(t, create("s-m1", alice.GetSandboxId()), codes.PermissionDenied, "SANDBOX_TENANT_MISMATCH")
	apierrtest.RequireStatus(t, create("s-m2", session.SandboxFor("org1", "bob")), codes.PermissionDenied, "SANDBOX_TENANT_MISMATCH")
	for _, id := range []string{"s-m1", "s-m2"} {
		_, err := e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: id})
		apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
		_, ok := e.creds.secret("cref-" + id)
		require.False(t, ok, "no credential stored for %s", id)
	}

	// A sandbox id of its own choosing is the first claimant's.
	require.NoError(t, create("s-m3", "team-room"))
	_, err := e.api.CreateSession(e.ctx, &sessionv1.CreateSessionRequest{
		SessionId: "s-a2", UserId: "alice", OrgId: "org1", SandboxId: "team-room",
		Worktree:   &sessionv1.Worktree{Directory: "/work/repo"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-a"},
	})
	apierrtest.RequireStatus(t, err, codes.PermissionDenied, "SANDBOX_TENANT_MISMATCH")
}

// A directory the session's workspace cannot be bound at inside its sandbox
// (a system path every sandbox mounts, or /tmp itself) is refused at
// CreateSession with its own reason and a field violation, and nothing is
// stored; a directory below /tmp, or one that only starts like a system
// path, is accepted (issue 32 item 5).
func TestCreateSessionRefusesADirectoryTheSandboxMounts(t *testing.T) {
	e := newEnv(t)
	create := func(id, dir string) error {
		_, err := e.api.CreateSession(e.ctx, &sessionv1.CreateSessionRequest{
			SessionId: id, UserId: "u1", OrgId: "o1", Worktree: &sessionv1.Worktree{Directory: dir},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-1"},
		})
		return err
	}
	for i, dir := range []string{"/proc", "/proc/self", "/usr/src/app", "/etc", "/tmp", "/run/agentplane", "/dev/shm/x", "/sys/x", "/lib64/x"} {
		id := fmt.Sprintf("s-r%d", i)
		err := create(id, dir)
		apierrtest.RequireStatus(t, err, codes.InvalidArgument, "DIRECTORY_RESERVED")
		v := apierr.FieldViolations(err)
		require.Len(t, v, 1, dir)
		require.Equal(t, "worktree.directory", v[0].GetField())
		_, err = e.api.GetSession(e.ctx, &sessionv1.GetSessionRequest{SessionId: id})
		apierrtest.RequireStatus(t, err, codes.NotFound, "SESSION_NOT_FOUND")
	}
	for i, dir := range []string{"/tmp/repo", "/usrx/app", "/home/u/repo"} {
		require.NoError(t, create(fmt.Sprintf("s-ok%d", i), dir), dir)
	}
}

// Once StopLoops closes, the service calls the sandbox service no more
// (agentplane dev stops that one next) but goes on serving: a message is
// stored queued and a notification is answered, and neither starts a
// Prepare or a Deliver (TestDevCtrlCInATerminal failed a loaded CI run on a
// drain's call to the stopped sandbox service).
func TestStopLoopsEndsPeerCallsButNotServing(t *testing.T) {
	stop := make(chan struct{})
	e := newEnv(t, func(c *Config) { c.StopLoops = stop })
	e.create("s1", "u1", "/work/repo")
	e.send("s1", "m1", "one")
	eventually(t, func() bool { return e.sandbox.count(e.sandbox.prepares, "s1") > 0 }, "first prepare")

	close(stop)
	e.svc.Close() // waits for the loops and drains the close stopped
	prepares := e.sandbox.count(e.sandbox.prepares, "s1")
	e.send("s1", "m2", "two")
	e.ready("s1", "w1")
	e.svc.Close() // waits for the drains the two calls kicked
	require.Equal(t, prepares, e.sandbox.count(e.sandbox.prepares, "s1"))
	require.Empty(t, e.sandbox.deliveredTo("s1"))
	require.Equal(t, sessionv1.MessageState_MESSAGE_STATE_QUEUED, e.message("s1", "m2").GetState())
}
