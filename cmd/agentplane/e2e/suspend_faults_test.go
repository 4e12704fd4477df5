package e2e

import (
	"context"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/cmd/agentplane/internal/sandboxprocs"
	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// wrappersOf lists the pids of the sandbox's wrapper processes (the
// agentplane-wrapper binary with the sandbox's marker; not bubblewrap, not
// the runtime). A child of a wrapper is not one: between its fork and its
// exec a process the wrapper starts still shows the wrapper's binary and
// environment. Zombies run nothing and are left out.
func wrappersOf(sandboxID string) []int {
	procs, _ := sandboxprocs.Live()
	parent := map[int]int{}
	for _, p := range procs {
		if filepath.Base(p.Exe) == filepath.Base(wrapperBin) && p.Has("AGENTPLANE_SANDBOX="+sandboxID) {
			parent[p.PID] = p.PPID
		}
	}
	var pids []int
	for pid, ppid := range parent {
		if _, forked := parent[ppid]; !forked {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	return pids
}

// wrapperCensus samples the sandbox's wrappers until stopped and keeps the
// most it saw at once: a count, never a duration.
type wrapperCensus struct {
	most int
	stop func()
}

func countWrappers(t *testing.T, sandboxID string) *wrapperCensus {
	c := &wrapperCensus{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			c.most = max(c.most, len(wrappersOf(sandboxID)))
			time.Sleep(10 * time.Millisecond)
		}
	})
	c.stop = func() { cancel(); wg.Wait() }
	t.Cleanup(c.stop)
	return c
}

// keyStopping returns the lease state of a runtime key of the sandbox
// whose stop is under way (stop_needed or stopping), as its owner reports
// it, or UNSPECIFIED.
func (s *suite) keyStopping(sandboxID string) sandboxv1.LeaseState {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := s.sbx.Status(ctx, &sandboxv1.StatusRequest{SandboxId: sandboxID, Tenant: e2eTenant})
	if err != nil {
		return sandboxv1.LeaseState_LEASE_STATE_UNSPECIFIED
	}
	for _, k := range st.GetSandbox().GetRuntimeKeys() {
		switch k.GetLeaseState() {
		case sandboxv1.LeaseState_LEASE_STATE_STOP_NEEDED, sandboxv1.LeaseState_LEASE_STATE_STOPPING:
			return k.GetLeaseState()
		}
	}
	return sandboxv1.LeaseState_LEASE_STATE_UNSPECIFIED
}

// suspendThrough calls SuspendSession until it answers suspended, across a
// sandbox restart: SUSPEND_PENDING and UNAVAILABLE are retried. A stop the
// dead replica claimed waits for its watchdog (45 s) before the next
// attempt, so the bound is generous.
func (s *suite) suspendThrough(t *testing.T, id string) {
	t.Helper()
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		resp, err := s.ses.SuspendSession(ctx, &sessionv1.SuspendSessionRequest{SessionId: id})
		if err != nil {
			t.Logf("SuspendSession: %v", err)
			return false
		}
		return resp.GetSession().GetRoute().GetState() == sessionv1.RouteState_ROUTE_STATE_SUSPENDED
	}, 5*time.Minute, 200*time.Millisecond, "the session was never suspended after the restart")
}

// requireNoLeak deletes the sessions and checks nothing of the sandbox runs
// any more: no process with its marker, nothing under the sandbox root.
func (s *suite) requireNoLeak(t *testing.T, sandboxID string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		s.deleteSession(t, id)
	}
	require.Empty(t, wrapperPIDs(t, sandboxID), "no process of the sandbox remains")
	require.Empty(t, sandboxprocs.Under(s.root), "no wrapper or runtime runs under the sandbox root")
}

// TestSandboxKilledWhileSuspending (issue 35, "Faults and bad input"):
// kill -9 of the sandbox service while a runtime key is being suspended —
// its wrapper frozen (SIGSTOP), so the stop cannot be verified before the
// kill lands while the key's lease says the stop is under way. After a
// restart the suspend completes (the new replica stops the frozen wrapper
// itself), no process of the sandbox runs, and the next message resumes
// the session under its runtime session id with the workspace kept; at no
// moment from the kill on does the sandbox run two wrappers; deleting it
// leaves nothing behind.
func TestSandboxKilledWhileSuspending(t *testing.T) {
	s, sbx := startProcSuite(t)
	sess := s.create(t, "sbx-kill-suspending", "/work/e2e-kill-suspending", newSecret())
	id, sandboxID := sess.GetSessionId(), sess.GetSandboxId()
	s.turn(t, id, "m1", "write: kept.txt before the crash")
	rs := s.routeView(t, id).GetRuntimeSessionId()

	// The stop under way is seen by a poll; should the stop complete
	// between two polls (the frozen wrapper is SIGKILLed about a second
	// after its SIGTERM), the session is resumed and the suspend tried again.
	killed := false
	for attempt := 1; attempt <= 3 && !killed; attempt++ {
		pids := wrappersOf(sandboxID)
		require.Len(t, pids, 1, "one wrapper serves the session before the suspend")
		require.NoError(t, syscall.Kill(pids[0], syscall.SIGSTOP))
		answered := make(chan error, 1)
		go func() {
			_, err := s.ses.SuspendSession(context.Background(), &sessionv1.SuspendSessionRequest{SessionId: id})
			answered <- err
		}()
		deadline := time.Now().Add(2 * time.Minute)
	poll:
		for {
			if st := s.keyStopping(sandboxID); st != sandboxv1.LeaseState_LEASE_STATE_UNSPECIFIED {
				sbx.kill9()
				t.Logf("attempt %d: SIGKILL with the key's lease %s", attempt, st)
				killed = true
				break
			}
			select {
			case err := <-answered: // the stop was verified between two polls
				t.Logf("attempt %d: SuspendSession answered before the kill: %v", attempt, err)
				break poll
			default:
			}
			require.True(t, time.Now().Before(deadline), "the suspend never began")
			time.Sleep(5 * time.Millisecond)
		}
		if !killed {
			t.Logf("attempt %d: the suspend completed before the kill; resuming to try again", attempt)
			_, err := s.ses.ResumeSession(context.Background(), &sessionv1.ResumeSessionRequest{SessionId: id})
			require.NoError(t, err)
		}
	}
	require.True(t, killed, "the kill never landed while the key was stopping")
	census := countWrappers(t, sandboxID)
	sbx.start()

	s.suspendThrough(t, id)
	s.requireSuspended(t, sess)

	events := s.turn(t, id, "m2", "after the crash while suspending")
	require.Contains(t, filesOfTurn(events, "m2"), "kept.txt", "the workspace survived")
	require.Equal(t, rs, s.routeView(t, id).GetRuntimeSessionId(), "the resumed route keeps its runtime session")
	require.Len(t, wrappersOf(sandboxID), 1)
	census.stop()
	require.LessOrEqual(t, census.most, 1, "never two wrappers of the sandbox's one runtime key")

	s.requireNoLeak(t, sandboxID, id)
}

// TestSandboxKilledWhileResuming (issue 35, "Faults and bad input"):
// kill -9 of the sandbox service while a suspended session is being
// resumed — its new wrapper launched and its route still preparing, held
// there by a credential service that accepts connections and never answers
// (no handle can be minted; a refused connection would fail the route at
// once, too soon for a loaded machine to see it preparing).
// The restart follows at once (the wrapper may still reconnect). The
// resume then completes: the route is ready under the same runtime
// session id with one wrapper, the next message answers with the workspace
// kept; at no moment from the kill on does the sandbox run two wrappers;
// deleting it leaves nothing behind.
func TestSandboxKilledWhileResuming(t *testing.T) {
	s, sbx, credCut := startProcSuiteCut(t)
	sess := s.create(t, "sbx-kill-resuming", "/work/e2e-kill-resuming", newSecret())
	id, sandboxID := sess.GetSessionId(), sess.GetSandboxId()
	s.turn(t, id, "m1", "write: kept.txt before the crash")
	rs := s.routeView(t, id).GetRuntimeSessionId()
	_, err := s.suspend(t, id, false)
	require.NoError(t, err)
	s.requireSuspended(t, sess)

	credCut.setHold(true)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	resumed := make(chan error, 1)
	go func() {
		_, err := s.ses.ResumeSession(ctx, &sessionv1.ResumeSessionRequest{SessionId: id})
		resumed <- err
	}()
	require.Eventually(t, func() bool {
		return len(wrappersOf(sandboxID)) == 1 && s.routeView(t, id).GetState() == sessionv1.RouteState_ROUTE_STATE_PREPARING
	}, 2*time.Minute, 10*time.Millisecond, "the resume never launched the wrapper")
	census := countWrappers(t, sandboxID)
	sbx.kill9()
	select {
	case err := <-resumed:
		t.Fatalf("ResumeSession answered before the route could be ready: %v", err)
	default:
	}
	credCut.setHold(false)
	sbx.start()

	if err := <-resumed; err != nil {
		// A route failed meanwhile (credential_unavailable, retryable) ends
		// the call; the caller resumes again.
		t.Logf("ResumeSession across the crash: %v (reason %s)", err, apierr.Reason(err))
		require.Eventually(t, func() bool {
			_, err := s.ses.ResumeSession(ctx, &sessionv1.ResumeSessionRequest{SessionId: id})
			return err == nil
		}, 5*time.Minute, 200*time.Millisecond, "the session never resumed after the restart")
	}
	v := s.routeView(t, id)
	require.Equal(t, sessionv1.RouteState_ROUTE_STATE_READY, v.GetState())
	require.Equal(t, rs, v.GetRuntimeSessionId(), "the resumed route keeps its runtime session")

	events := s.turn(t, id, "m2", "after the crash while resuming")
	require.Contains(t, filesOfTurn(events, "m2"), "kept.txt", "the workspace survived")
	require.Len(t, wrappersOf(sandboxID), 1)
	census.stop()
	require.LessOrEqual(t, census.most, 1, "never two wrappers of the sandbox's one runtime key")

	s.requireNoLeak(t, sandboxID, id)
}
