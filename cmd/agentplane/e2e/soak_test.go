package e2e

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// soakDuration is how long the churn soak runs: AGENTPLANE_SOAK (a Go
// duration, e.g. 10m) or 3 minutes, which keeps it in `make test`'s bound.
func soakDuration(t *testing.T) time.Duration {
	v := os.Getenv("AGENTPLANE_SOAK")
	if v == "" {
		return 3 * time.Minute
	}
	d, err := time.ParseDuration(v)
	require.NoError(t, err, "AGENTPLANE_SOAK")
	return d
}

// Soak shape: 20 worktrees over 4 sandboxes, one worker per worktree
// creating, messaging and deleting sessions in a loop.
const (
	soakWorktrees = 20
	soakSandboxes = 4
	soakSessions  = 200 // the count the default run must reach
)

// allowedKey is every key shape without a TTL that may outlive the
// sessions, runtimes and histories the soak deleted: a fence token counter
// (never expires, so a resource's tokens stay monotonic across its
// lifetimes), the session tombstone (wipe locator) and the ingest
// tombstone. The session service's state counts (ses:idx:states, behind the
// sessions-by-state gauge) stay too, and must read 0 once every session is
// gone (checked apart). Keys with a TTL (handles, scope versions, leases) go by
// themselves; a live sandbox's records (its owner lease still held) are
// not orphans.
var allowedKey = []*regexp.Regexp{
	regexp.MustCompile(`^fence:\{[^}]+\}:token$`),
	// A sandbox's tenant binding stays while its tree on disk does (one
	// per sandbox, never per session; internal/control/tenancy); a sandbox let go
	// of loses both (TestNothingOutlivesItsSessions checks that strictly).
	regexp.MustCompile(`^sbx:\{sbx/[^}]+\}:tenant$`),
	regexp.MustCompile(`^ses:wipe:\{ses/[^}]+\}$`),
	regexp.MustCompile(`^ing:\{rs_[^}]+\}:meta$`),
}

var sandboxKey = regexp.MustCompile(`^sbx:\{(sbx/[^}]+)\}:`)

// rssSample is one reading of a service process's resident memory.
type rssSample struct {
	at  time.Duration
	kib int
}

// TestChurnSoak (issue 20 acceptance): two replicas of each service; 20
// worktrees whose sessions are created, messaged and deleted in a loop
// (200 sessions in the default run) for soakDuration. Afterwards no
// process runs under the sandbox root (host /proc scan), no message got
// stuck, Redis holds only the key shapes of allowedKey, and each service
// process's RSS in the last minute is within 20% of the first minute's.
func TestChurnSoak(t *testing.T) {
	d := soakDuration(t)
	// Empty sandboxes are let go of 1s after their last session.
	r := startReplicated(t, "SANDBOX_EMPTY_GRACE", "1s")
	services := append(append(append(slices.Clone(r.session), r.cred...), r.ingest...), r.sandbox[0].proc, r.sandbox[1].proc)

	start := time.Now()
	rss := map[string][]rssSample{}
	var rssMu sync.Mutex
	sampled := make(chan struct{})
	stopSampling := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(2 * time.Second)
		defer tick.Stop()
		for {
			rssMu.Lock()
			for _, p := range services {
				rss[p.name] = append(rss[p.name], rssSample{at: time.Since(start), kib: rssKiB(p.pid())})
			}
			rssMu.Unlock()
			select {
			case <-stopSampling:
				return
			case <-tick.C:
			}
		}
	}()

	var created, stuck atomic.Int64
	var errMu sync.Mutex
	var errs []error
	fail := func(err error) {
		errMu.Lock()
		errs = append(errs, err)
		errMu.Unlock()
	}
	deadline := start.Add(d)
	var wg sync.WaitGroup
	for w := range soakWorktrees {
		wg.Go(func() {
			sandboxID := fmt.Sprintf("sbx-soak%d-%s", w%soakSandboxes, r.run)
			for n := 0; time.Now().Before(deadline); n++ {
				if err := r.churnOnce(sandboxID, fmt.Sprintf("/work/soak-%d", w), &stuck); err != nil {
					fail(fmt.Errorf("worktree %d session %d: %w", w, n, err))
					return
				}
				created.Add(1)
			}
		})
	}
	wg.Wait()
	close(stopSampling)
	<-sampled
	elapsed := time.Since(start)
	require.Empty(t, errs)
	require.Zero(t, stuck.Load(), "stuck messages")
	t.Logf("churn soak: %d sessions created, messaged and deleted in %v over %d worktrees, %d sandboxes, 2 replicas of each service",
		created.Load(), elapsed.Round(time.Second), soakWorktrees, soakSandboxes)
	if os.Getenv("AGENTPLANE_SOAK") == "" {
		require.GreaterOrEqual(t, created.Load(), int64(soakSessions), "the default soak reaches %d sessions", soakSessions)
	}

	// 0 leaked processes: nothing carrying the sandbox-root marker runs but
	// the two sandbox replicas themselves.
	var leaked []int
	require.Eventually(t, func() bool {
		leaked = markedProcesses(r.root, services)
		return len(leaked) == 0
	}, 30*time.Second, 200*time.Millisecond, "processes left under %s", r.root)

	// 0 orphaned keys.
	r.requireOnlyAllowedKeys(t)

	// Nothing a sandbox replica holds grows with the number of sessions.
	r.requireFlatSandboxReplicas(t)

	// Memory flat, per service: the peak of its replicas' summed RSS in the
	// last window within 20% (16 MiB for a small total) of the first
	// window's. Summed, because sandboxes, and the memory that drives them,
	// move between a service's replicas as ownership changes: one loaded
	// run saw sandbox-b grow 28% while sandbox-a held still (+17% summed).
	window := min(time.Minute, elapsed/4)
	for name, samples := range sumByService(rss) {
		first, last := peakRSS(samples, 0, window), peakRSS(samples, elapsed-window, elapsed)
		t.Logf("RSS %s (replicas summed): first %v peak %d KiB, last %v peak %d KiB (%+.1f%%)", name, window, first, window, last,
			100*float64(last-first)/float64(first))
		require.LessOrEqual(t, float64(last), max(1.2*float64(first), float64(first+16<<10)), "%s RSS grew more than 20%%", name)
	}
}

// sumByService adds up, sample by sample, the RSS of each service's
// replicas (processes named service-a, service-b; sampled together).
func sumByService(rss map[string][]rssSample) map[string][]rssSample {
	out := map[string][]rssSample{}
	for proc, samples := range rss {
		name, _, _ := strings.Cut(proc, "-")
		sum := out[name]
		for i, s := range samples {
			if i < len(sum) {
				sum[i].kib += s.kib
			} else {
				sum = append(sum, s)
			}
		}
		out[name] = sum
	}
	return out
}

// churnOnce is one session's life: create in the worktree, one message
// until completed (counted stuck when it never completes), delete until
// the session is gone.
func (r *replicated) churnOnce(sandboxID, dir string, stuck *atomic.Int64) error {
	ctx := context.Background()
	var sess *sessionv1.Session
	if err := retry(60*time.Second, func() error {
		resp, err := r.client.CreateSession(ctx, &sessionv1.CreateSessionRequest{
			UserId: "u-soak", OrgId: "o-soak", SandboxId: sandboxID, Worktree: &sessionv1.Worktree{Directory: dir},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
		})
		sess = resp.GetSession()
		return err
	}); err != nil {
		return fmt.Errorf("create: %w", err)
	}
	id := sess.GetSessionId()
	if err := retry(60*time.Second, func() error {
		_, err := r.client.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, MessageId: "m1", Content: "churn"})
		return err
	}); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	done := time.Now().Add(120 * time.Second)
	for {
		resp, err := r.client.GetMessage(ctx, &sessionv1.GetMessageRequest{SessionId: id, MessageId: "m1"})
		state := resp.GetMessage().GetState()
		if err == nil && state == sessionv1.MessageState_MESSAGE_STATE_COMPLETED {
			break
		}
		if err == nil && state > sessionv1.MessageState_MESSAGE_STATE_COMPLETED {
			return fmt.Errorf("message %s ended %v", id, resp.GetMessage())
		}
		if time.Now().After(done) {
			stuck.Add(1)
			return fmt.Errorf("message of %s stuck %v (err %w)", id, state, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return retry(120*time.Second, func() error {
		_, err := r.client.DeleteSession(ctx, &sessionv1.DeleteSessionRequest{SessionId: id})
		if status.Code(err) == codes.NotFound {
			return nil
		}
		if apierr.Reason(err) == "DELETION_PENDING_CLEANUP" {
			delay, _ := apierr.RetryDelay(err)
			time.Sleep(delay)
			return err
		}
		return err
	})
}

// retry calls f until it succeeds or within passes; it retries what a
// caller of a replicated service retries (and DELETION_PENDING_CLEANUP).
func retry(within time.Duration, f func() error) error {
	deadline := time.Now().Add(within)
	for {
		err := f()
		if err == nil {
			return nil
		}
		if (!retryable(err) && apierr.Reason(err) != "DELETION_PENDING_CLEANUP") || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// markedProcesses lists live processes carrying the sandbox-root marker of
// root (bubblewrap, its init, wrappers, runtimes), but for the services.
func markedProcesses(root string, services []*proc) []int {
	marker := []byte("\x00AGENTPLANE_SANDBOX_ROOT=" + root + "\x00")
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || slices.ContainsFunc(services, func(p *proc) bool { return p.pid() == pid }) {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil || !bytes.Contains(append([]byte{0}, env...), marker) {
			continue
		}
		if stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && bytes.Contains(stat, []byte(") Z ")) {
			continue
		}
		out = append(out, pid)
	}
	return out
}

func peakRSS(samples []rssSample, from, to time.Duration) int {
	peak := 0
	for _, s := range samples {
		if s.at >= from && s.at <= to {
			peak = max(peak, s.kib)
		}
	}
	return peak
}

// keyShape is a key with its ids replaced by <id>, to count and name
// what a SCAN finds.
var idPart = regexp.MustCompile(`[0-9a-f]{8}(-?[0-9a-f]{4,})*|[0-9A-Za-z_-]{20,}`)

// requireOnlyAllowedKeys SCANs the whole key space until no key is left
// whose shape allowedKey does not list, and fails (logging the shapes
// found) if one stays. An empty sandbox is let go of by its owner's tick
// after its grace, so the last ones may still be on their way out: a key
// that went between the SCAN and its read is gone, not orphaned.
func (r *replicated) requireOnlyAllowedKeys(t *testing.T) {
	t.Helper()
	rdb := r.rs.Client(t)
	ctx := context.Background()
	var shapes map[string]int
	var orphans []string
	census := func() bool {
		shapes, orphans = map[string]int{}, nil
		iter := rdb.Scan(ctx, 0, "*", 1000).Iterator()
		for iter.Next(ctx) {
			k := iter.Val()
			ttl := rdb.PTTL(ctx, k).Val()
			if ttl == -2 { // go-redis keeps PTTL's -2 as is: gone since the SCAN
				continue
			}
			shape := idPart.ReplaceAllString(k, "<id>")
			if ttl > 0 {
				shape += " (ttl)"
			}
			shapes[shape]++
			live := k == "sbx:index"
			if k == "ses:idx:states" {
				counts := rdb.HGetAll(ctx, k).Val()
				for state, n := range counts {
					require.Equal(t, "0", n, "sessions still counted %s after every session was deleted", state)
				}
				live = true
			}
			if m := sandboxKey.FindStringSubmatch(k); m != nil {
				live = rdb.Exists(ctx, "fence:{"+m[1]+"}:lease").Val() == 1
			}
			if ttl <= 0 && !live && !slices.ContainsFunc(allowedKey, func(re *regexp.Regexp) bool { return re.MatchString(k) }) {
				orphans = append(orphans, k)
			}
		}
		require.NoError(t, iter.Err())
		return len(orphans) == 0
	}
	// In this goroutine (census asserts), rechecked for up to a minute.
	for deadline := time.Now().Add(time.Minute); !census() && time.Now().Before(deadline); {
		time.Sleep(time.Second)
	}
	for _, s := range slices.Sorted(maps.Keys(shapes)) {
		t.Logf("key shape %s: %d", s, shapes[s])
	}
	require.Empty(t, orphans, "keys other than tombstones and fence counters")
}

// sandboxFootprint is what the sandbox replicas hold once every session is
// gone: per replica its goroutines, and the sandbox keys in Redis (every
// sbx:* key but the tenant bindings, and the sandboxes' owner leases).
type sandboxFootprint struct {
	goroutines []float64
	keys       int
}

// footprint waits until no sandbox replica owns a sandbox (each lets its
// empty sandboxes go) and reads the footprint.
func (r *replicated) footprint(t *testing.T) sandboxFootprint {
	t.Helper()
	var f sandboxFootprint
	for _, rep := range r.sandbox {
		require.Eventually(t, func() bool { return scrape(t, rep.metrics)["sandbox_owned_sandboxes"] == 0 },
			60*time.Second, 200*time.Millisecond, "%s still owns sandboxes after every session was deleted", rep.name)
		f.goroutines = append(f.goroutines, scrape(t, rep.metrics)["go_goroutines"])
	}
	rdb := r.rs.Client(t)
	ctx := context.Background()
	for _, pattern := range []string{"sbx:*", "fence:{sbx/*}:lease"} {
		iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			if !strings.HasSuffix(iter.Val(), ":tenant") {
				f.keys++
			}
		}
		require.NoError(t, iter.Err())
	}
	return f
}

// requireFlatSandboxReplicas (issue 33 item 4): after the soak, every
// session deleted, no replica owns a sandbox; another round of sessions in
// every worktree, and calls that only talk to the soak's sandboxes (Abort,
// Deliver, UpdateEgressPolicy, Status of unknown sessions) at each replica,
// leave the same footprint: owned sandboxes 0, goroutines and sandbox keys
// no more than before.
func (r *replicated) requireFlatSandboxReplicas(t *testing.T) {
	t.Helper()
	before := r.footprint(t)
	var stuck atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, soakWorktrees)
	for w := range soakWorktrees {
		wg.Go(func() {
			if err := r.churnOnce(fmt.Sprintf("sbx-soak%d-%s", w%soakSandboxes, r.run), fmt.Sprintf("/work/soak-%d", w), &stuck); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	// The extra sessions' sandboxes are let go of again, tenant bindings
	// included (nothing of a sandbox outlives its last session); then the
	// calls that only talk find a sandbox bound to nobody, which answers as
	// another tenant's does (internal/control/tenancy), and take nothing over: no
	// replica owns the sandbox and no binding is written.
	r.footprint(t)
	ctx := context.Background()
	rdb := r.rs.Client(t)
	tenant := &sandboxv1.Tenant{OrgId: "o-soak", UserId: "u-soak"}
	const unbound = "SANDBOX_TENANT_MISMATCH"
	for _, rep := range r.sandbox {
		for i := range soakSandboxes {
			sb := fmt.Sprintf("sbx-soak%d-%s", i, r.run)
			for j := range 25 {
				s := fmt.Sprintf("talk-%d", j)
				_, err := rep.client.Abort(ctx, &sandboxv1.AbortRequest{Tenant: tenant, SandboxId: sb, SessionId: s, MessageId: "m"})
				require.Equal(t, unbound, apierr.Reason(err), "%v", err)
				_, err = rep.client.Deliver(ctx, &sandboxv1.DeliverRequest{Tenant: tenant, SandboxId: sb, SessionId: s,
					Messages: []*sandboxv1.DeliveryMessage{{MessageId: "m", Content: "talk"}}})
				require.Equal(t, unbound, apierr.Reason(err), "%v", err)
				_, err = rep.client.UpdateEgressPolicy(ctx, &sandboxv1.UpdateEgressPolicyRequest{Tenant: tenant, SandboxId: sb, SessionId: s, Version: 1})
				require.Equal(t, unbound, apierr.Reason(err), "%v", err)
				_, err = rep.client.Status(ctx, &sandboxv1.StatusRequest{Tenant: tenant, SandboxId: sb, SessionId: s})
				require.Equal(t, unbound, apierr.Reason(err), "%v", err)
			}
			require.Zero(t, rdb.Exists(ctx, "sbx:{sbx/"+sb+"}:tenant").Val(), "a call that only talks binds nothing")
		}
	}
	for _, rep := range r.sandbox {
		require.Zero(t, scrape(t, rep.metrics)["sandbox_owned_sandboxes"], "%s took sandboxes over it was only asked about", rep.name)
	}
	after := r.footprint(t)
	t.Logf("sandbox replicas with no session: goroutines %v then %v, sandbox keys %d then %d",
		before.goroutines, after.goroutines, before.keys, after.keys)
	require.LessOrEqual(t, after.keys, before.keys, "sandbox keys grew with the sessions")
	for i, rep := range r.sandbox {
		require.Eventually(t, func() bool {
			return scrape(t, rep.metrics)["go_goroutines"] <= before.goroutines[i]+10
		}, 60*time.Second, 500*time.Millisecond, "%s goroutines grew with the sessions (from %v)", rep.name, before.goroutines[i])
	}
}
