package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/testenv"
)

// Hostile scripts a tenant's runtime writes into its worktree ("write:") and runs ("run: sh
// <file>") in the agent's nested sandbox, by the scripted runtime's tools or, steered by the
// fake model, by opencode's. perl is the host's (/usr is in every sandbox).
const (
	// seeProcesses lists every process the runtime can name, tries each one's environ for a
	// launch credential, and SIGSTOPs any wrapper it can name.
	seeProcesses = `for d in /proc/[0-9]*; do
p=${d#/proc/}
[ "$p" = "$$" ] && continue
set -- $(tr '\0' ' ' < $d/cmdline 2>/dev/null)
echo "visible $p $1 $2"
if grep -q aplc_ $d/environ 2>/dev/null; then echo "credential $p"; fi
if [ "$2" = wrapper ] && kill -STOP $p 2>/dev/null; then echo "stopped $p"; fi
done
echo done`

	// hideProcess leaves a process behind that made itself non-dumpable: its /proc files
	// belong to a root its sandbox does not map, unreadable to the sandbox service's uid.
	hideProcess = `setsid perl -e 'syscall(157, 4, 0, 0, 0, 0); $0 = "hidden-nodump"; sleep 600' </dev/null >/dev/null 2>&1 &
echo hidden`

	// floodSockets holds up to 900 connections (the sandbox's nofile is 1024) from each of
	// 4 processes to the wrapper's proxy listener (proxy_url, relayed to the service's proxy
	// socket) and to the egress listener (relayed to the service's egress socket), for 60 s,
	// from when flood.go appears in the worktree.
	floodSockets = `for i in 1 2 3 4; do
setsid perl -MIO::Socket::INET -e '
select(undef, undef, undef, 0.2) until -e "flood.go";
my @held; my @to = ("127.0.0.1:7405");
push @to, $1 if ($ENV{HTTP_PROXY} // "") =~ m{//([^/]+)};
for my $n (1..900) { my $s = IO::Socket::INET->new(PeerAddr => $to[$n % @to], Timeout => 2) or next; push @held, $s; }
sleep 60' </dev/null >/dev/null 2>&1 &
done
echo flooding`

	// requestHead sends a 200 MiB request line, then (on a new connection) 200 MiB of
	// headers, to the egress listener, and prints the status lines it got back.
	requestHead = `perl -MIO::Socket::INET -e '
$SIG{PIPE} = "IGNORE";
my ($to) = ($ENV{HTTP_PROXY} // "") =~ m{//([^/]+)} or die "no egress listener\n";
for my $kind ("line", "headers") {
  my $s = IO::Socket::INET->new(PeerAddr => $to, Timeout => 10) or die "connect $to: $!\n";
  my $chunk = "a" x (1 << 20);
  print $s ($kind eq "line" ? "GET http://example.com/" : "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n");
  for (1..200) { print $s ($kind eq "line" ? $chunk : "X-$_: $chunk\r\n") or last; }
  my $got = <$s> // "closed\n";
  print "$kind $got";
}'`
)

// TestChartShapedTenants (issue 31 acceptance, issue 34): two tenants of different orgs (and a
// third) on one deployment in the chart's shape (separate non-root uids, the sandbox service
// as 65532 with the chart's securityContext, secrets as files, the internal token on), each
// observation of issue 31 attempted by a hostile caller or a hostile scripted runtime, and
// refused. The memory and CPU hogs run without cgroups: on a cgroup v1 host a non-root service
// cannot make them, so memory is sampled and CPU weighted (docs/sandbox.md "Between tenants").
func TestChartShapedTenants(t *testing.T) {
	requirePerl(t)
	_, s, procs, _ := startChartSuite(t, chartOptions{sets: []string{"sandbox.limits.diskQuota=64MiB", "sandbox.limits.memory=256MiB"}})
	testChartShapedTenants(t, &tenantsRig{s: s, service: procs[svcSandbox].pid, memoryMiB: 256,
		authorizations: func() []string { auth, _ := s.up.seen(); return auth }})
}

// imageAgents is where an image carrying the pinned agents would hold them.
const imageAgents = "/opt/agentplane/agents"

// TestChartShapedTenantsOpenCode (issue 31: "the same e2e passes with the scripted runtime and
// with opencode"): TestChartShapedTenants with every session an opencode session (the pinned
// agent, bound where an image would carry it and set through the chart's sandbox.extraEnv),
// the fake model as the provider upstream and the only stand-in. The fake model steers
// opencode with the scripted runtime's messages: "write: <file> <text>" becomes a call of
// opencode's write tool, "run: <command>" a call of its bash tool, so the hostile scripts run
// as opencode's own tool runs them. The memory limit is the product's default (1 GiB): opencode
// alone holds more than the scripted runtime's 256 MiB.
func TestChartShapedTenantsOpenCode(t *testing.T) {
	requirePerl(t)
	dir := requireAgent(t, "opencode")
	model := fakemodel.New()
	_, s, procs, _ := startChartSuite(t, chartOptions{
		stack: stackOptions{upstream: model},
		sets: []string{"sandbox.limits.diskQuota=64MiB", "sandbox.limits.memory=1GiB",
			"sandbox.extraEnv[0].name=AGENTPLANE_AGENTS_DIR", "sandbox.extraEnv[0].value=" + imageAgents,
			"sandbox.extraEnv[1].name=AGENTPLANE_AGENT_MODEL", "sandbox.extraEnv[1].value=fake-model"},
		binds: map[string]string{imageAgents: dir},
	})
	s.turnBound = 4 * time.Minute // opencode starts slowly on a loaded node
	testChartShapedTenants(t, &tenantsRig{s: s, service: procs[svcSandbox].pid, memoryMiB: 1024, profile: "opencode",
		authorizations: func() []string {
			var auth []string
			for _, r := range model.Requests() {
				auth = append(auth, r.Authorization)
			}
			return auth
		}})
}

func requirePerl(t *testing.T) {
	if _, err := exec.LookPath("perl"); err != nil {
		testenv.Missing(t, "perl (the hostile runtime's scripts): %v", err)
	}
}

// tenantsRig is what a runtime brings to testChartShapedTenants: its deployment, started.
// Everything else (the messages, the hostile scripts, what must hold) is written once.
type tenantsRig struct {
	s       *suite
	service int    // the sandbox service's pid
	profile string // every session's agent profile ("": the scripted runtime)
	// memoryMiB is sandbox.limits.memory; the memory hog holds twice as much.
	memoryMiB int
	// authorizations lists the Authorization header of each request the provider upstream got.
	authorizations func() []string

	secrets map[string]bool // "Bearer <secret>" of every session created
}

// create makes a session of tn in sandbox sb (retried while the services come up).
func (r *tenantsRig) create(t *testing.T, tn *sandboxv1.Tenant, sb string) *sessionv1.Session {
	t.Helper()
	var out *sessionv1.Session
	require.Eventually(t, func() bool {
		secret := newSecret()
		var err error
		out, err = createAgentAs(r.s, tn, sb+"-"+r.s.run, "/work/"+tn.GetUserId(), secret, r.profile)
		if err == nil {
			if r.secrets == nil {
				r.secrets = map[string]bool{}
			}
			r.secrets["Bearer "+secret] = true
		}
		return err == nil
	}, 60*time.Second, 50*time.Millisecond, "create %s's session in %s", tn.GetUserId(), sb)
	require.Equal(t, r.profile, out.GetAgent().GetProfile(), "the session's runtime")
	return out
}

// hostile writes script as <name>.sh into the session's worktree and runs it with sh (by the
// runtime's own tools); it returns the script's output.
func (r *tenantsRig) hostile(t *testing.T, sessionID, name, script string) string {
	t.Helper()
	r.s.turn(t, sessionID, name+"-w", "write: "+name+".sh "+script)
	return runIn(t, r.s, sessionID, name+"-r", "sh", name+".sh")
}

func testChartShapedTenants(t *testing.T, r *tenantsRig) {
	s, service := r.s, r.service
	alice := &sandboxv1.Tenant{OrgId: "orgA-" + s.run, UserId: "alice"}
	mallory := &sandboxv1.Tenant{OrgId: "orgEvil-" + s.run, UserId: "mallory"}
	bob := &sandboxv1.Tenant{OrgId: "orgB-" + s.run, UserId: "bob"}
	t.Cleanup(func() { // what the wrappers and their runtimes said, when something failed
		if !t.Failed() {
			return
		}
		logs, _ := filepath.Glob(filepath.Join(s.root, "*", "logs", "*.log"))
		for _, l := range logs {
			t.Logf("wrapper log %s (last 8 KiB):\n%s", strings.TrimPrefix(l, s.root), readTail(l))
		}
	})

	var a, m *sessionv1.Session
	t.Run("session works", func(t *testing.T) {
		a = r.create(t, alice, "sbx-alice")
		s.turn(t, a.GetSessionId(), "a1", "write: secret.txt alice-secret")
		require.Contains(t, runIn(t, s, a.GetSessionId(), "a2", "cat", "secret.txt"), "alice-secret")
		files := findFile(t, s.root, "secret.txt")
		require.Len(t, files, 1, "one secret.txt under the sandbox root")
		b, err := os.ReadFile(files[0])
		require.NoError(t, err)
		require.Equal(t, "alice-secret\n", string(b))
		st, err := os.Stat(files[0])
		require.NoError(t, err)
		require.EqualValues(t, 65532, st.Sys().(*syscall.Stat_t).Uid, "written as the chart's uid")
		m = r.create(t, mallory, "sbx-mallory")
		s.turn(t, m.GetSessionId(), "m1", "hello")
		// The provider saw each session's backing secret and nothing else (never a handle).
		auth := r.authorizations()
		require.NotEmpty(t, auth)
		for _, h := range auth {
			require.True(t, r.secrets[h], "the provider got %.20q…, not a session's backing secret", h)
		}
		require.Len(t, r.secrets, 2)
		for h := range r.secrets {
			require.Contains(t, auth, h, "each session's turns reached the provider with its backing secret")
		}
	})
	require.False(t, t.Failed(), "no session: nothing else can be tried")

	t.Run("sandbox join", func(t *testing.T) {
		requireJoinRefused(t, s, alice, mallory, a)
	})

	t.Run("wrapper out of reach", func(t *testing.T) {
		out := r.hostile(t, m.GetSessionId(), "see", seeProcesses)
		t.Logf("what mallory's runtime sees:\n%s", out)
		require.Contains(t, out, "done")
		require.Contains(t, out, "visible", "it sees its own nested sandbox")
		require.NotContains(t, out, "credential", "a launch credential in a visible environ")
		require.NotContains(t, out, "stopped", "a wrapper was stopped")
		for line := range strings.Lines(out) {
			if f := strings.Fields(line); len(f) == 4 && f[0] == "visible" {
				require.NotEqual(t, "wrapper", f[3], "a wrapper is visible from inside: %s", line)
			}
		}
		// The second wall: each wrapper is non-dumpable, so even the sandbox's own uid on the
		// host (the service's) cannot read its environ or memory; none was stopped.
		wrappers := 0
		for _, pid := range descendants(t, service) {
			if argv := cmdline(pid); len(argv) > 1 && argv[1] == "wrapper" {
				wrappers++
				require.NotEqual(t, "T", procState(pid), "wrapper %d was stopped", pid)
				for _, f := range []string{"environ", "mem"} {
					out, err := exec.Command("setpriv", "--reuid=65532", "--regid=65532", "--clear-groups",
						"head", "-c", "1", fmt.Sprintf("/proc/%d/%s", pid, f)).CombinedOutput()
					require.Error(t, err, "wrapper %d's %s read as 65532", pid, f)
					require.Contains(t, string(out), "Permission denied", "wrapper %d's %s", pid, f)
				}
			}
		}
		require.GreaterOrEqual(t, wrappers, 2, "alice's and mallory's wrappers")
	})

	t.Run("non-dumpable runtime does not blind discovery", func(t *testing.T) {
		require.Contains(t, r.hostile(t, m.GetSessionId(), "hide", hideProcess), "hidden")
		var hidden int
		require.Eventually(t, func() bool {
			for _, pid := range descendants(t, service) {
				if argv := cmdline(pid); len(argv) > 0 && argv[0] == "hidden-nodump" {
					hidden = pid
				}
			}
			return hidden > 0
		}, 30*time.Second, 50*time.Millisecond, "mallory's hidden process runs")
		out, err := exec.Command("setpriv", "--reuid=65532", "--regid=65532", "--clear-groups",
			"head", "-c", "1", fmt.Sprintf("/proc/%d/environ", hidden)).CombinedOutput()
		require.Error(t, err, "the hidden process's environ is unreadable to the service's uid")
		require.Contains(t, string(out), "Permission denied")
		// Bob launches, works and deletes sessions (deletion verifies his wrapper absent).
		for i := range 2 {
			b := r.create(t, bob, fmt.Sprintf("sbx-bob-%d", i))
			s.turn(t, b.GetSessionId(), "b1", "hello from bob")
			s.deleteSession(t, b.GetSessionId())
		}
		require.Contains(t, runIn(t, s, a.GetSessionId(), "a3", "cat", "secret.txt"), "alice-secret")
	})

	t.Run("request head", func(t *testing.T) {
		before := vmKiB(t, service, "VmRSS")
		out := r.hostile(t, m.GetSessionId(), "head", requestHead)
		t.Logf("request heads:\n%s", out)
		require.Contains(t, out, "line HTTP/1.1 414")
		require.Contains(t, out, "headers HTTP/1.1 431")
		peak := vmKiB(t, service, "VmHWM")
		t.Logf("sandbox service RSS before %d KiB, peak after %d KiB", before, peak)
		require.Less(t, peak-before, 64<<10, "the sandbox service's RSS grew by 64 MiB or more")
	})

	t.Run("control socket serves only the wrapper", func(t *testing.T) {
		requireControlSocketServesOnlyTheWrapper(t, s, ctlprobe(t), m.GetSessionId(), a)
	})

	t.Run("fd flood on the handed-in sockets", func(t *testing.T) {
		require.Contains(t, r.hostile(t, m.GetSessionId(), "flood", floodSockets), "flooding")
		// The flooders wait for flood.go: an agent's turn still calls its model through the
		// proxy listener after its tool ran, and a sandbox that floods its own sockets starves
		// itself (that is the bound), so the flood starts once mallory's turn has ended.
		scripts := findFile(t, s.root, "flood.sh")
		require.Len(t, scripts, 1, "mallory's flood.sh")
		require.NoError(t, os.WriteFile(filepath.Join(filepath.Dir(scripts[0]), "flood.go"), nil, 0o644))
		require.Eventually(t, func() bool { return countOpen(descendants(t, service)) > 2000 }, 60*time.Second, 100*time.Millisecond,
			"mallory's flooders hold their connections")
		t.Logf("sandbox service descriptors under the flood: %d", countOpen([]int{service}))
		// Bob's cold first turn in a new sandbox, while the flood holds.
		b := r.create(t, bob, "sbx-bob-flood")
		events := s.turn(t, b.GetSessionId(), "b1", "hello under a flood")
		require.NotEmpty(t, runtimeEvents(events, "b1"), "bob's runtime answered")
	})

	// No cgroup can be made here (cgroup v1, the service not root): the sampling enforcer
	// stops a runtime key over its memory limit, and CPU is weighted (nice 10, SCHED_BATCH).
	t.Run("memory hog", func(t *testing.T) {
		b := r.create(t, bob, "sbx-bob-mem")
		s.turn(t, b.GetSessionId(), "b1", "hello before the hog")
		hog := r.create(t, mallory, "sbx-mallory-mem")
		s.turn(t, hog.GetSessionId(), "h1", "write: hog.sh "+memHog("mem-hog", 2*r.memoryMiB))
		_, err := s.ses.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: hog.GetSessionId(), MessageId: "h2",
			Content: "run: sh hog.sh"})
		require.NoError(t, err)
		require.Equal(t, "memory_limit", s.messageFailure(t, hog.GetSessionId(), "h2"))
		s.turn(t, b.GetSessionId(), "b2", "hello after the hog")
	})

	t.Run("CPU hog", func(t *testing.T) {
		hog := r.create(t, mallory, "sbx-mallory-cpu")
		require.Contains(t, r.hostile(t, hog.GetSessionId(), "spin", spinAllCores), "spinning")
		var spinners []int
		require.Eventually(t, func() bool {
			spinners = spinners[:0]
			for _, pid := range descendants(t, service) {
				if argv := cmdline(pid); len(argv) > 0 && argv[0] == "cpu-hog" {
					spinners = append(spinners, pid)
				}
			}
			return len(spinners) >= runtime.NumCPU()
		}, 30*time.Second, 50*time.Millisecond, "mallory's spinners run")
		for _, pid := range spinners {
			nice, policy := schedOf(t, pid)
			require.Equal(t, 10, nice, "spinner %d's nice value", pid)
			require.Equal(t, 3, policy, "spinner %d's policy: SCHED_BATCH", pid)
		}
		// Bob's turn completes while every core spins (its duration is not asserted).
		b := r.create(t, bob, "sbx-bob-cpu")
		require.NotEmpty(t, runtimeEvents(s.turn(t, b.GetSessionId(), "b1", "hello under a CPU hog"), "b1"), "bob's runtime answered")
		s.deleteSession(t, hog.GetSessionId())
	})

	t.Run("disk filler", func(t *testing.T) {
		filler := r.create(t, mallory, "sbx-mallory-disk")
		requireDiskQuotaHolds(t, s, filler.GetSessionId(), func() string {
			return r.create(t, bob, "sbx-bob-disk").GetSessionId()
		})
	})

	// Alice's session outlived all of it.
	require.Contains(t, runIn(t, s, a.GetSessionId(), "a9", "cat", "secret.txt"), "alice-secret")
}

// spinAllCores starts two busy loops per core, named cpu-hog, in the background.
const spinAllCores = `n=$(($(nproc) * 2)); i=0; while [ $i -lt $n ]; do setsid perl -e '$0 = "cpu-hog"; 1 while 1' </dev/null >/dev/null 2>&1 & i=$((i + 1)); done; echo spinning`

// schedOf reads a process's nice value and scheduling policy (stat fields 19 and 41).
func schedOf(t testing.TB, pid int) (int, int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(t, err)
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	nice, err := strconv.Atoi(f[16])
	require.NoError(t, err)
	policy, err := strconv.Atoi(f[38])
	require.NoError(t, err)
	return nice, policy
}

// descendants lists every live process below pid (host pids).
func descendants(t testing.TB, pid int) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	require.NoError(t, err)
	parent := map[int]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(f) > 1 {
			parent[p], _ = strconv.Atoi(f[1])
		}
	}
	var out []int
	for p := range parent {
		for q := parent[p]; q > 1; q = parent[q] {
			if q == pid {
				out = append(out, p)
				break
			}
		}
	}
	return out
}

func cmdline(pid int) []string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
}

func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	return strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))[0]
}

// countOpen counts the open descriptors of pids (read as root).
func countOpen(pids []int) int {
	n := 0
	for _, p := range pids {
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p))
		n += len(ents)
	}
	return n
}

// vmKiB is a field of /proc/<pid>/status in KiB (VmRSS, VmHWM).
func vmKiB(t testing.TB, pid int, field string) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			require.NoError(t, err)
			return n
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}
