package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testaddr"
	sandbox "agentplane.dev/services/sandbox/server"
)

// ledger is what callers saw acknowledged during a run: a message whose
// SendMessage returned, a message read as completed, a message state
// delivered by WatchSession.
type ledger struct {
	mu        sync.Mutex
	acked     map[string]bool // session/message
	completed map[string]bool // session/message
	states    map[string]bool // session/message/state
	retries   map[string]int  // reason of each retried SendMessage
	// since (with markSince) starts the served clock: served is when each
	// session first completed a message acknowledged after it.
	since  time.Time
	served map[string]time.Time
}

func newLedger() *ledger {
	return &ledger{acked: map[string]bool{}, completed: map[string]bool{}, states: map[string]bool{}, retries: map[string]int{},
		served: map[string]time.Time{}}
}

// markSince starts the served clock now.
func (l *ledger) markSince() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.since = time.Now()
	return l.since
}

// completedAt notes that sessionID's message acknowledged at ackedAt completed now.
func (l *ledger) completedAt(sessionID string, ackedAt time.Time) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.served[sessionID]; !ok && !l.since.IsZero() && ackedAt.After(l.since) {
		l.served[sessionID] = now
	}
}

func (l *ledger) servedAt(sessionID string) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	at, ok := l.served[sessionID]
	return at, ok
}

func (l *ledger) note(m map[string]bool, k string) {
	l.mu.Lock()
	m[k] = true
	l.mu.Unlock()
}

func (l *ledger) completedOf(sessionID string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for k := range l.completed {
		if len(k) > len(sessionID) && k[:len(sessionID)+1] == sessionID+"/" {
			n++
		}
	}
	return n
}

// load sends messages to one session until stop, each retried with its id
// until acknowledged and then followed until it completes.
func (s *suite) load(t *testing.T, l *ledger, sessionID string, stop <-chan struct{}) {
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		mid := fmt.Sprintf("m-%03d", i)
		deadline := time.Now().Add(60 * time.Second)
		for {
			_, err := s.ses.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: sessionID, MessageId: mid, Content: "turn " + mid})
			if err == nil {
				break
			}
			reason := status.Code(err).String()
			if r := apierr.Reason(err); r != "" {
				reason = r
			}
			l.mu.Lock()
			l.retries[reason]++
			l.mu.Unlock()
			if time.Now().After(deadline) {
				t.Errorf("SendMessage %s/%s not acknowledged within 60s: %v", sessionID, mid, err)
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		ackedAt := time.Now()
		l.note(l.acked, sessionID+"/"+mid)
		for time.Now().Before(deadline) {
			resp, err := s.ses.GetMessage(context.Background(), &sessionv1.GetMessageRequest{SessionId: sessionID, MessageId: mid})
			if err == nil && resp.GetMessage().GetState() == sessionv1.MessageState_MESSAGE_STATE_COMPLETED {
				l.note(l.completed, sessionID+"/"+mid)
				l.completedAt(sessionID, ackedAt)
				break
			}
			if apierr.Reason(err) == "MESSAGE_NOT_FOUND" {
				break // lost in the failover (min0): the ledger shows it
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// underLoad runs, for each session, a sender (load) and a watcher that
// notes every delivered message state in l and hands each event to seen
// (may be nil), until halt (also called at cleanup, before the suite stops).
func (s *suite) underLoad(t *testing.T, l *ledger, sessions []string, seen func(id string, ev *sessionv1.SessionEvent)) (halt func()) {
	wctx, stopWatch := context.WithCancel(context.Background())
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var stopOnce sync.Once
	halt = func() {
		stopOnce.Do(func() {
			close(stop)
			time.Sleep(time.Second) // the watchers deliver the last states
			stopWatch()
			wg.Wait()
		})
	}
	t.Cleanup(halt)
	for _, id := range sessions {
		wg.Go(func() {
			s.watch(wctx, id, func(ev *sessionv1.SessionEvent) {
				if seen != nil {
					seen(id, ev)
				}
				if m := ev.GetMessage(); m != nil {
					l.note(l.states, stateKey(id, m))
				}
			})
		})
		wg.Go(func() { s.load(t, l, id, stop) })
	}
	return halt
}

// watch records every message state WatchSession delivers, resuming after
// the last cursor when the stream breaks, until ctx ends.
func (s *suite) watch(ctx context.Context, sessionID string, seen func(ev *sessionv1.SessionEvent)) {
	cursor := ""
	for ctx.Err() == nil {
		stream, err := s.ses.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sessionID, Cursor: cursor})
		for err == nil {
			var resp *sessionv1.WatchSessionResponse
			if resp, err = stream.Recv(); err == nil {
				cursor = resp.GetEvent().GetCursor()
				seen(resp.GetEvent())
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func stateKey(sessionID string, m *sessionv1.Message) string {
	return sessionID + "/" + m.GetMessageId() + "/" + m.GetState().String()
}

// losses compares the ledger with what the services hold after the run:
// every acknowledged message listed, every completed one completed, every
// delivered state in a full replay of the event log.
func (s *suite) losses(t *testing.T, l *ledger, sessions []string) (lost []string) {
	for _, id := range sessions {
		held := map[string]sessionv1.MessageState{}
		token := ""
		for {
			resp, err := s.ses.ListMessages(context.Background(), &sessionv1.ListMessagesRequest{SessionId: id, PageSize: 500, PageToken: token})
			require.NoError(t, err)
			for _, m := range resp.GetMessages() {
				held[id+"/"+m.GetMessageId()] = m.GetState()
			}
			if token = resp.GetNextPageToken(); token == "" {
				break
			}
		}
		replayed := map[string]bool{}
		ctx, cancel := context.WithCancel(context.Background())
		idle := time.AfterFunc(3*time.Second, cancel)
		s.watch(ctx, id, func(ev *sessionv1.SessionEvent) {
			idle.Reset(2 * time.Second)
			if m := ev.GetMessage(); m != nil {
				replayed[stateKey(id, m)] = true
			}
		})
		cancel()
		l.mu.Lock()
		for k := range l.acked {
			if _, ok := held[k]; !ok && k[:len(id)+1] == id+"/" {
				lost = append(lost, "acknowledged message "+k+" not listed")
			}
		}
		for k := range l.completed {
			if held[k] != sessionv1.MessageState_MESSAGE_STATE_COMPLETED && k[:len(id)+1] == id+"/" {
				lost = append(lost, "completed message "+k+" now "+held[k].String())
			}
		}
		for k := range l.states {
			if !replayed[k] && k[:len(id)+1] == id+"/" {
				lost = append(lost, "delivered state "+k+" not in the replay")
			}
		}
		l.mu.Unlock()
	}
	return lost
}

// plannedFailover runs SENTINEL FAILOVER and returns once the sentinels
// name another master, with the time the attempt that did it took. Sentinel
// aborts a failover whose promotion it does not see within its
// failover-timeout (10 s here), which a loaded machine can cause; the
// failover is then asked for again (a test of the services needs the switch,
// not Sentinel's first attempt), three attempts at most. The sentinels' logs
// are printed when none switched.
func plannedFailover(t *testing.T, g *redistest.SentinelGroup) time.Duration {
	t.Helper()
	ctx := t.Context()
	before, err := g.MasterAddr(ctx)
	require.NoError(t, err)
	for attempt := 1; attempt <= 3; attempt++ {
		started := time.Now()
		if err := g.Failover(ctx); err != nil && !strings.Contains(err.Error(), "INPROG") {
			require.NoError(t, err, "SENTINEL FAILOVER")
		}
		// Longer than failover-timeout: an attempt still running then has been aborted.
		for time.Since(started) < 25*time.Second {
			if after, err := g.MasterAddr(ctx); err == nil && after != before {
				return time.Since(started)
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Logf("failover attempt %d: the sentinels still name %s after 25s", attempt, before)
	}
	for _, s := range g.Sentinels {
		b, _ := os.ReadFile(filepath.Join(s.Dir(), "redis.log"))
		t.Logf("sentinel %s log:\n%s", s.Addr(), b)
	}
	t.Fatalf("no failover from %s in 3 attempts", before)
	return 0
}

// TestSentinelFailoverAcks (issue 20): four
// sessions over two sandboxes send and complete messages without pause while
// a sentinel runs SENTINEL FAILOVER. With AGENTPLANE_REDIS_MIN_REPLICAS=1 no
// message a caller saw acknowledged or completed, and no delivered message
// state, is missing afterwards (ListMessages and a full event replay). The
// same run with 0 reports what it lost: the trade-off of decision 48 (the
// old master takes writes until the sentinel demotes it, and they die with
// its resync; whether any fell in that window is timing, so the figure is
// reported, not asserted).
func TestSentinelFailoverAcks(t *testing.T) {
	for _, min := range []int{1, 0} {
		t.Run(fmt.Sprintf("min%d", min), func(t *testing.T) {
			g := redistest.StartSentinel(t)
			s := startSuiteAt(t, nil, nil, store{URL: g.URL(), MinReplicas: min})
			l := newLedger()

			var sessions []string
			for i := range 4 {
				dir := filepath.Join(s.root, fmt.Sprintf("w%d", i))
				require.NoError(t, os.MkdirAll(dir, 0o755))
				sessions = append(sessions, s.create(t, fmt.Sprintf("sbx-fo%d", i%2), dir, "sk-failover").GetSessionId())
			}
			halt := s.underLoad(t, l, sessions, nil)
			progressed := func(n int) {
				t.Helper()
				deadline := time.Now().Add(2 * time.Minute)
				for _, id := range sessions {
					for l.completedOf(id) < n {
						require.True(t, time.Now().Before(deadline), "session %s completed %d messages, want %d", id, l.completedOf(id), n)
						time.Sleep(50 * time.Millisecond)
					}
				}
			}
			progressed(2)

			promoted := plannedFailover(t, g)
			at := make(map[string]int, len(sessions))
			for _, id := range sessions {
				at[id] = l.completedOf(id)
			}
			deadline := time.Now().Add(2 * time.Minute)
			for _, id := range sessions { // two more messages each after the switch
				for l.completedOf(id) < at[id]+2 {
					require.True(t, time.Now().Before(deadline), "session %s made no progress after the failover", id)
					time.Sleep(50 * time.Millisecond)
				}
			}
			halt()

			lost := s.losses(t, l, sessions)
			l.mu.Lock()
			t.Logf("min_replicas=%d: promotion %v; %d messages acknowledged, %d seen completed, %d states delivered; retried SendMessage: %v; lost %d",
				min, promoted.Round(time.Millisecond), len(l.acked), len(l.completed), len(l.states), l.retries, len(lost))
			l.mu.Unlock()
			for _, x := range lost {
				t.Logf("lost: %s", x)
			}
			if min > 0 {
				require.Empty(t, lost, "writes acknowledged with WAIT went missing")
			}
		})
	}
}

// wrappers are the pids of this suite's wrapper processes.
func (s *suite) wrappers(t *testing.T) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		exe, _ := os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
		env, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if filepath.Base(exe) == filepath.Base(wrapperBin) && strings.Contains(string(env), "-"+s.run) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestSentinelFailoverKeepsSandboxes (issue 20 item 5, issue 33 item 5):
// the sole sandbox replica, with AGENTPLANE_REDIS_MIN_REPLICAS=1, through a
// SENTINEL FAILOVER and then a stretch where no write can be confirmed (the
// new master's replica paused) until every owner lease is past its deadline
// unconfirmed: it keeps its sandboxes — no "owner lease lost", no "another
// replica drives", no lease loss counted, the same wrapper processes — and
// once writes are confirmed again every session is served. A renewal that
// could not be confirmed is not a lease another replica took. The owner TTL
// is short (renewal every 2.7s) so that renewals fall in the failover; after
// the resume the replica's resync took 12-16 s here before writes were
// confirmed again, within the 5 TTLs a holder waits before it lets go.
func TestSentinelFailoverKeepsSandboxes(t *testing.T) {
	g := redistest.StartSentinel(t)
	metricsAddr := testaddr.Addr(t)
	s := startSuiteAt(t, nil, func(c *sandbox.Config) {
		c.OwnerTTL = 8 * time.Second
		c.MetricsAddr = metricsAddr
	}, store{URL: g.URL(), MinReplicas: 1})
	metrics := "http://" + metricsAddr + "/metrics"
	var ids []string
	for i := range 3 {
		dir := filepath.Join(s.root, fmt.Sprintf("k%d", i))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		id := s.create(t, fmt.Sprintf("sbx-keep%d", i), dir, "sk-keep").GetSessionId()
		s.turn(t, id, "m-1", "before")
		ids = append(ids, id)
	}
	before := s.wrappers(t)
	require.NotEmpty(t, before, "the sandboxes' wrappers (and their runtimes) run")
	require.InDelta(t, float64(len(ids)), scrape(t, metrics)["sandbox_owned_sandboxes"], 0)

	ctx := t.Context()
	began := time.Now()
	plannedFailover(t, g)
	// The old master rejoins as the new one's replica: until then every
	// write (renewals too) is STORE_NOT_REPLICATED.
	require.NoError(t, g.WaitHealthy(ctx))
	t.Logf("group healthy again %v after the failover began", time.Since(began).Round(time.Millisecond))

	// No write is confirmed while the new master's one replica (the old
	// master) is paused: hold it until every owner lease is past its
	// deadline without a confirmed renewal.
	master, err := g.MasterAddr(ctx)
	require.NoError(t, err)
	replica := g.Replica
	if replica.Addr() == master {
		replica = g.Master
	}
	require.NoError(t, replica.Pause())
	t.Logf("%v: replica %s paused (master %s)", time.Since(began).Round(time.Millisecond), replica.Addr(), master)
	require.Eventually(t, func() bool {
		return scrape(t, metrics)["sandbox_owner_leases_unconfirmed"] == float64(len(ids))
	}, 60*time.Second, 100*time.Millisecond, "every owner lease unconfirmed past its deadline")
	require.NoError(t, replica.Resume())
	t.Logf("%v: every owner lease unconfirmed; replica resumed", time.Since(began).Round(time.Millisecond))
	require.Eventually(t, func() bool { return scrape(t, metrics)["sandbox_owner_leases_unconfirmed"] == 0 },
		60*time.Second, 100*time.Millisecond, "the owner leases are confirmed again")
	t.Logf("%v: owner leases confirmed again", time.Since(began).Round(time.Millisecond))
	require.NoError(t, g.WaitHealthy(ctx))

	for _, id := range ids {
		s.turn(t, id, "m-2", "after")
	}
	m := scrape(t, metrics)
	for _, line := range strings.Split(s.logs.String(), "\n") {
		if strings.Contains(line, "driving") || strings.Contains(line, "lease") || strings.Contains(line, "took over") {
			t.Log(line)
		}
	}
	require.InDelta(t, float64(len(ids)), m["sandbox_owned_sandboxes"], 0, "the replica kept every sandbox")
	require.Zero(t, m["sandbox_owner_leases_unconfirmed"])
	require.Zero(t, m["sandbox_owner_lease_losses_total"], "no owner lease counted lost")
	logs := s.logs.String()
	require.NotContains(t, logs, "owner lease lost")
	require.NotContains(t, logs, "another sandbox-service replica drives")
	require.NotContains(t, logs, "stale fencing token")
	require.Equal(t, before, s.wrappers(t), "the same wrappers serve after the failover")
}
