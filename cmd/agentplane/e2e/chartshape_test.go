package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	"agentplane.dev/pkg/testaddr"
	"agentplane.dev/pkg/testenv"
	sandbox "agentplane.dev/services/sandbox/server"
)

// The chart-shaped suite (issue 34): every service runs as the Helm chart's rendered pod spec
// says (deploy/helm/cmd/podshape renders it with the Helm SDK): as the pod's uid and gids with
// no capability and no_new_privs, in its own PID, IPC and UTS namespaces (the agentplane binary
// is PID 1, as in the image), on a read-only root where only the chart's writable mounts
// (emptyDir /tmp, the sandbox root) can be written, with the chart's Secret keys as files at
// the chart's paths (mode and group as the kubelet makes them), the ConfigMap and container
// environment as rendered, and the sandbox service's isolation settings. Only the network
// wiring is the test's: loopback addresses instead of Service names, and a private Redis.
//
// What differs from a pod: the services share the host's network namespace (they reach each
// other on loopback), and the sandbox service runs as host uid 65532 instead of uid 65532 in a
// user namespace of its own (hostUsers: false): it holds no more privilege than in the pod.

// chartShape is podshape's output.
type chartShape struct {
	Services map[string]*podShape `json:"services"`
}

type podShape struct {
	Args                     []string     `json:"args"`
	UID                      int64        `json:"uid"`
	GID                      int64        `json:"gid"`
	FSGroup                  int64        `json:"fsGroup"`
	RunAsNonRoot             bool         `json:"runAsNonRoot"`
	ReadOnlyRootFilesystem   bool         `json:"readOnlyRootFilesystem"`
	AllowPrivilegeEscalation bool         `json:"allowPrivilegeEscalation"`
	Privileged               bool         `json:"privileged"`
	CapabilitiesDrop         []string     `json:"capabilitiesDrop"`
	CapabilitiesAdd          []string     `json:"capabilitiesAdd"`
	HostUsers                *bool        `json:"hostUsers"`
	ProcMount                string       `json:"procMount"`
	Env                      []shapeEnv   `json:"env"`
	Mounts                   []shapeMount `json:"mounts"`
}

type shapeEnv struct {
	Name, Value, FieldPath string
}

type shapeMount struct {
	Path     string            `json:"path"`
	ReadOnly bool              `json:"readOnly"`
	Kind     string            `json:"kind"`
	Files    map[string]string `json:"files"`
	Mode     int32             `json:"mode"`
}

// Where the image puts the binaries (Dockerfile).
const (
	imageBinary  = "/usr/local/bin/agentplane"
	imageWrapper = "/usr/local/bin/agentplane-wrapper"
)

// renderChartShape renders the chart with the default CI values and redisURL
// and the --set values sets.
func renderChartShape(t testing.TB, redisURL string, sets ...string) *chartShape {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	helmDir := filepath.Join(filepath.Dir(file), "..", "..", "..", "deploy", "helm")
	args := []string{"run", "./cmd/podshape", "-f", "agentplane/ci/default-values.yaml", "--set", "redis.url=" + redisURL}
	for _, kv := range sets {
		args = append(args, "--set", kv)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = helmDir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "render the chart: %s", stderr.String())
	var shape chartShape
	require.NoError(t, json.Unmarshal(out, &shape))
	for _, svc := range allServices {
		require.Contains(t, shape.Services, svc)
	}
	return &shape
}

// requireChartShapeTools: the harness runs as root (to make the mounts and switch to the
// pod's uid) with bubblewrap and setpriv; under CI=true their absence fails the test.
func requireChartShapeTools(t testing.TB) {
	t.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	for _, tool := range []string{"bwrap", "setpriv"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if len(missing) == 0 {
		return
	}
	testenv.Missing(t, "the chart-shaped suite needs %v", missing)
}

// rootMadeCgroupParents makes the sandbox cgroup parents under this process's groups as a root
// sandbox service does at start-up (every other e2e test's, on this host and in CI): the
// chart's non-root service then finds them there and must not take them for its own (before
// the fix its every launch failed to make a group and the route never became ready).
func rootMadeCgroupParents(t testing.TB) {
	t.Helper()
	if ok, why := sandbox.CgroupLimits(); !ok {
		t.Logf("no cgroup limits as root here (%s): the non-root service cannot find root's parents", why)
	}
}

// chartProc is one service started in its pod's shape; pid is the agentplane process (PID 1
// of its PID namespace) as the host sees it.
type chartProc struct {
	name string
	cmd  *exec.Cmd
	pid  int
	logs string
	done chan struct{}
	// metrics is its /metrics URL ("" when the chart serves none).
	metrics string
}

// startChartShaped starts the four services of st in the chart's shape; the returned suite
// talks to them at st's addresses.
func startChartShaped(t testing.TB, st *stack, shape *chartShape, binds map[string]string) map[string]*chartProc {
	t.Helper()
	st.releaseListeners()
	secrets := map[string]string{
		"internal-token":  token,
		"credential-key":  st.env[svcCredential]["CREDENTIAL_KEY"],
		"attestation-key": st.env[svcCredential]["ATTESTATION_KEY"],
	}
	procs := map[string]*chartProc{}
	for _, svc := range []string{svcCredential, svcIngest, svcSandbox, svcSession} {
		var b map[string]string
		if svc == svcSandbox {
			b = binds
		}
		procs[svc] = startChartProc(t, st, svc, shape.Services[svc], secrets, b)
	}
	return procs
}

// wiring is the test's value of each setting that names a network address: loopback
// addresses replace the chart's Service names and pod ports; every other setting is the chart's.
func wiring(st *stack, svc string) map[string]string {
	return map[string]string{
		"GRPC_ADDR": st.addr[svc], "PROXY_ADDR": st.addr["proxy"],
		"SESSION_ADDR": st.addr[svcSession], "SANDBOX_ADDR": st.addr[svcSandbox],
		"CREDENTIAL_ADDR": st.addr[svcCredential], "INGEST_ADDR": st.addr[svcIngest],
		"SANDBOX_PROXY_URL": "http://" + st.addr["proxy"], "SANDBOX_ADVERTISE_ADDR": st.addr[svcSandbox],
	}
}

func chartEnv(t testing.TB, st *stack, svc string, p *podShape) []string {
	t.Helper()
	vals := map[string]string{}
	var order []string
	expand := func(s string) string {
		// The kubelet's $(VAR) expansion of earlier variables.
		return os.Expand(strings.NewReplacer("$(", "${", ")", "}").Replace(s), func(k string) string { return vals[k] })
	}
	setVal := func(k, v string) {
		if _, ok := vals[k]; !ok {
			order = append(order, k)
		}
		vals[k] = v
	}
	// What the kubelet adds: the pod's name as HOSTNAME, the image's PATH.
	setVal("HOSTNAME", "ap-agentplane-"+svc+"-0")
	setVal("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	for _, e := range p.Env {
		switch {
		case e.FieldPath == "status.podIP":
			setVal(e.Name, "127.0.0.1")
		case e.FieldPath != "":
			t.Fatalf("%s: env %s from %s: unknown to the harness", svc, e.Name, e.FieldPath)
		default:
			setVal(e.Name, expand(e.Value))
		}
	}
	for k, v := range wiring(st, svc) {
		if _, chart := vals["AGENTPLANE_"+k]; chart {
			setVal("AGENTPLANE_"+k, v)
		}
	}
	if _, chart := vals["AGENTPLANE_METRICS_ADDR"]; chart {
		setVal("AGENTPLANE_METRICS_ADDR", testaddr.Addr(t))
	}
	if svc == svcCredential { // the chart leaves the provider at its default, the test has its own
		setVal("AGENTPLANE_PROVIDER_UPSTREAM", st.env[svc]["PROVIDER_UPSTREAM"])
	}
	require.Equal(t, st.env[svc]["REDIS_URL"], vals["AGENTPLANE_REDIS_URL"], "%s: the chart renders the Redis URL it was given", svc)
	env := make([]string, 0, len(order))
	for _, k := range order {
		env = append(env, k+"="+vals[k])
	}
	return env
}

// binds are what the image would carry besides the binaries (the installed agents): host paths
// bound read-only at their image paths.
func startChartProc(t testing.TB, st *stack, svc string, p *podShape, secrets, binds map[string]string) *chartProc {
	t.Helper()
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o755))
	targets := map[string]bindSpec{
		imageBinary:  {src: agentplaneBinary(t), file: true},
		imageWrapper: {src: wrapperBin, file: true},
	}
	for at, src := range binds {
		targets[at] = bindSpec{src: src}
	}
	for _, m := range p.Mounts {
		switch m.Kind {
		case "emptyDir":
			// An emptyDir is a fresh directory anyone may write (0777), as the kubelet makes it.
			targets[m.Path] = bindSpec{tmpfs: true}
		case "secret":
			// The kubelet's secret volume: root-owned files of the chosen keys, group fsGroup,
			// mode defaultMode.
			src := filepath.Join(dir, "secret-"+strings.ReplaceAll(strings.Trim(m.Path, "/"), "/", "-"))
			require.NoError(t, os.Mkdir(src, 0o755))
			for key, name := range m.Files {
				v, ok := secrets[key]
				require.True(t, ok, "%s: the chart mounts secret key %q the test does not know", svc, key)
				f := filepath.Join(src, name)
				require.NoError(t, os.WriteFile(f, []byte(v), 0o600))
				require.NoError(t, os.Chown(f, 0, int(p.FSGroup)))
				require.NoError(t, os.Chmod(f, os.FileMode(m.Mode)))
			}
			targets[m.Path] = bindSpec{src: src}
		case "pvc":
			// The sandbox root (a PVC or an emptyDir): the stack's root, writable by fsGroup.
			require.NoError(t, os.Chown(st.root, int(p.UID), int(p.FSGroup)))
			targets[m.Path] = bindSpec{src: st.root, writable: !m.ReadOnly}
		default:
			t.Fatalf("%s: mount kind %q unknown to the harness", svc, m.Kind)
		}
	}
	require.True(t, p.ReadOnlyRootFilesystem, "%s: the chart runs a read-only root", svc)
	require.False(t, p.Privileged || p.AllowPrivilegeEscalation || len(p.CapabilitiesAdd) > 0, "%s: privilege", svc)
	require.Equal(t, []string{"ALL"}, p.CapabilitiesDrop, "%s: capabilities", svc)

	args := []string{"--die-with-parent", "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts",
		"--hostname", "ap-agentplane-" + svc + "-0", "--info-fd", "3"}
	unmasked := p.ProcMount == "Unmasked"
	args = append(args, rootArgs(t, targets, unmasked)...)
	setpriv := []string{"/usr/bin/setpriv", "--reuid=" + strconv.FormatInt(p.UID, 10), "--regid=" + strconv.FormatInt(p.GID, 10),
		"--groups=" + strconv.FormatInt(p.FSGroup, 10), "--inh-caps=-all", "--bounding-set=-all"}
	if !p.AllowPrivilegeEscalation {
		setpriv = append(setpriv, "--no-new-privs")
	}
	args = append(args, "--")
	if unmasked {
		// procMount: Unmasked: a fresh procfs of the pod's PID namespace with nothing over it
		// (bubblewrap's own --proc covers /proc/sys and others read-only, as the runtime's
		// masked paths do, and then no nested sandbox can mount its /proc).
		args = append(args, "/bin/sh", "-c", `mount -t proc proc /proc && exec "$@"`, "sh")
	}
	args = append(args, setpriv...)
	args = append(args, imageBinary)
	args = append(args, p.Args...)

	cp := &chartProc{name: svc, logs: filepath.Join(dir, svc+".log"), done: make(chan struct{})}
	logf, err := os.Create(cp.logs)
	require.NoError(t, err)
	info, infoW, err := os.Pipe()
	require.NoError(t, err)
	cp.cmd = exec.Command("bwrap", args...)
	cp.cmd.Env = chartEnv(t, st, svc, p)
	for _, kv := range cp.cmd.Env {
		if addr, ok := strings.CutPrefix(kv, "AGENTPLANE_METRICS_ADDR="); ok && addr != "" {
			cp.metrics = "http://" + addr + "/metrics"
		}
	}
	cp.cmd.Stdout, cp.cmd.Stderr = logf, logf
	cp.cmd.ExtraFiles = []*os.File{infoW}
	require.NoError(t, cp.cmd.Start())
	_ = infoW.Close()
	go func() { _ = cp.cmd.Wait(); _ = logf.Close(); close(cp.done) }()
	var started struct {
		ChildPID int `json:"child-pid"`
	}
	err = json.NewDecoder(bufio.NewReader(info)).Decode(&started)
	_ = info.Close()
	require.NoError(t, err, "%s: bwrap did not start it: %s", svc, readTail(cp.logs))
	cp.pid = started.ChildPID
	t.Cleanup(func() {
		cp.stop()
		if t.Failed() {
			t.Logf("%s log (last 8 KiB):\n%s", svc, readTail(cp.logs))
		}
	})
	return cp
}

func readTail(path string) string {
	b, _ := os.ReadFile(path)
	return string(tail(b, 8<<10))
}

// stop sends SIGTERM to the service (PID 1 of its namespace handles it) and waits.
func (p *chartProc) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = syscall.Kill(p.pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
		<-p.done
	}
}

// bindSpec is what appears at a path of the service's root: src bound (read-only unless
// writable) or a fresh tmpfs.
type bindSpec struct {
	src      string
	file     bool
	writable bool
	tmpfs    bool
}

// rootArgs are bubblewrap arguments for a read-only copy of the host's root with targets
// mounted on it: every directory on the way to a target becomes a tmpfs holding read-only
// binds of its host entries (so the target's mount point can be made), and is then made
// read-only itself. /proc is a fresh procfs of the new PID namespace (masked as the runtime
// does by default, or not at all for procMount: Unmasked), /dev a minimal one.
func rootArgs(t testing.TB, targets map[string]bindSpec, unmasked bool) []string {
	t.Helper()
	ancestors := map[string]bool{"/": true}
	for p := range targets {
		for d := filepath.Dir(p); d != "/"; d = filepath.Dir(d) {
			ancestors[d] = true
		}
	}
	var args, remount []string
	var walk func(dir string)
	walk = func(dir string) {
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		for _, e := range entries {
			p := filepath.Join(dir, e.Name())
			if _, ok := targets[p]; ok {
				continue
			}
			switch {
			case p == "/proc" || p == "/dev":
				continue
			case e.Type()&os.ModeSymlink != 0:
				dest, err := os.Readlink(p)
				require.NoError(t, err)
				args = append(args, "--symlink", dest, p)
			case ancestors[p]:
				args = append(args, "--perms", "0755", "--tmpfs", p)
				remount = append(remount, p)
				walk(p)
			default:
				args = append(args, "--ro-bind", p, p)
			}
		}
	}
	walk("/")
	if unmasked {
		args = append(args, "--tmpfs", "/proc", "--dev", "/dev") // procfs mounted over it before the service starts
	} else {
		args = append(args, "--proc", "/proc", "--dev", "/dev")
	}
	// Directories on the way that the host does not have (bubblewrap would make them 0700).
	for _, d := range slices.Sorted(maps.Keys(ancestors)) {
		if _, err := os.Lstat(d); os.IsNotExist(err) {
			args = append(args, "--perms", "0755", "--dir", d)
		}
	}
	for _, p := range slices.Sorted(maps.Keys(targets)) {
		b := targets[p]
		switch {
		case b.tmpfs:
			args = append(args, "--perms", "0777", "--tmpfs", p)
		case b.writable:
			args = append(args, "--bind", b.src, p)
		default:
			args = append(args, "--ro-bind", b.src, p)
		}
	}
	// Read-only last: the directories made on the way hold their mount points by now.
	for _, p := range remount {
		args = append(args, "--remount-ro", p)
	}
	return append(args, "--remount-ro", "/")
}

// chartOptions: the stack's options (its log level is info), the chart's --set values, and
// binds into the sandbox service's root (image path -> host path, read-only).
type chartOptions struct {
	stack stackOptions
	sets  []string
	binds map[string]string
}

// startChartSuite starts the four services in the chart's shape as o says, after root made the
// sandbox cgroup parents; it returns their stack, the suite that talks to them, the processes
// and the shape.
func startChartSuite(t testing.TB, o chartOptions) (*stack, *suite, map[string]*chartProc, *chartShape) {
	t.Helper()
	requireChartShapeTools(t)
	rootMadeCgroupParents(t)
	o.stack.logLevel = "info"
	st := newStack(t, o.stack)
	// No idle suspend (the chart's default is 2 min) unless a test sets one: a hostile
	// tenant's sub-tests count the other tenants' wrappers minutes after their last turn.
	sets := append([]string{"session.suspendAfter=0s"}, o.sets...)
	shape := renderChartShape(t, st.env[svcSession]["REDIS_URL"], sets...)
	procs := startChartShaped(t, st, shape, o.binds)
	return st, st.suite(), procs, shape
}

// TestChartShapedSession (issue 34): the four services started as the chart's pods run them,
// a scripted session end to end: a turn whose runtime calls the provider through the
// credential proxy, with the sandbox service as uid 65532 launching the wrapper under the
// chart's isolation (namespaces).
func TestChartShapedSession(t *testing.T) {
	// With a warm pool at the session's directory: the claim renames, records and relabels as
	// the service's uid in the pod's namespaces (DESIGN.md 3.8).
	st, s, procs, shape := startChartSuite(t, chartOptions{sets: []string{"sandbox.pool.sizes.scripted=1", "sandbox.pool.directory=/work/chart-repo"}})
	sbx := shape.Services[svcSandbox]
	require.EqualValues(t, 65532, sbx.UID, "the chart runs the sandbox service as 65532")
	require.True(t, sbx.RunAsNonRoot)
	require.Contains(t, sbx.Env, shapeEnv{Name: "AGENTPLANE_SANDBOX_ISOLATION", Value: "namespaces"})

	// What the pod's process is: uid, gids, capabilities, no_new_privs (from /proc, as root),
	// once bubblewrap has made the mounts and executed it.
	for svc, p := range procs {
		var status []byte
		require.Eventually(t, func() bool {
			exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", p.pid))
			status, _ = os.ReadFile(fmt.Sprintf("/proc/%d/status", p.pid))
			return exe == imageBinary || filepath.Base(exe) == "agentplane"
		}, 2*time.Minute, 50*time.Millisecond, "%s: not started: %s", svc, readTail(p.logs))
		want := shape.Services[svc]
		id := strconv.FormatInt(want.UID, 10)
		require.Contains(t, string(status), "Uid:\t"+id+"\t"+id+"\t"+id+"\t"+id+"\n", svc)
		require.Contains(t, string(status), "CapEff:\t0000000000000000\n", svc)
		require.Contains(t, string(status), "CapBnd:\t0000000000000000\n", svc)
		require.Contains(t, string(status), "NoNewPrivs:\t1\n", svc)
		environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", p.pid))
		require.NoError(t, err, svc)
		for _, v := range []string{token, st.env[svcCredential]["CREDENTIAL_KEY"]} {
			require.NotContains(t, string(environ), v, "%s: a secret in the environment", svc)
		}
	}

	secret := newSecret()
	require.NotEmpty(t, procs[svcSandbox].metrics, "the chart serves the sandbox service's metrics")
	require.Eventually(t, func() bool {
		// The service serves /metrics a moment after its process starts.
		m, err := tryScrape(procs[svcSandbox].metrics)
		return err == nil && sum(m, "agentplane_sandbox_pool_size", `profile="scripted"`) == 1
	}, time.Minute, 50*time.Millisecond, "the pool has a sandbox ready")
	sess := s.create(t, "sbx-chart", "/work/chart-repo", secret)
	events := s.turn(t, sess.GetSessionId(), "m1", "hello from the chart's shape")
	require.NotZero(t, claimedBy(t, st.root, sess.GetSandboxId()), "the session's route took the pooled sandbox")
	var provider map[string]any
	for _, ev := range events {
		if re := ev.GetRuntimeEvent(); re != nil && re.GetToolName() == "provider" && re.GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT {
			provider = re.GetData().AsMap()
		}
	}
	require.NotNil(t, provider, "the runtime reported its provider call")
	require.EqualValues(t, 200, provider["status"])
	auth, _ := s.up.seen()
	require.Contains(t, auth, "Bearer "+secret, "the upstream got the backing secret through the proxy")

	// The service could write nothing but the chart's writable mounts: its root stayed
	// read-only (a write from inside its mount namespace fails), the sandbox root holds the
	// sandbox's files, owned by the pod's uid.
	sandboxPID := procs[svcSandbox].pid
	out, err := exec.Command("nsenter", "-t", strconv.Itoa(sandboxPID), "-m",
		"setpriv", "--reuid=65532", "--regid=65532", "--clear-groups", "sh", "-c",
		"touch /etc/x 2>&1; touch /usr/local/bin/x 2>&1; touch /tmp/x && echo tmp-ok").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Equal(t, 2, strings.Count(string(out), "Read-only file system"), "%s", out)
	require.Contains(t, string(out), "tmp-ok")
	var owned int
	require.NoError(t, filepath.Walk(st.root, func(path string, info os.FileInfo, err error) error {
		if err == nil && info.Sys().(*syscall.Stat_t).Uid == 65532 {
			owned++
		}
		return nil
	}))
	require.Positive(t, owned, "the sandbox service wrote under the chart's sandbox root as 65532")

	// Issue 32 as deployed: the service, as 65532, removes the deleted session's workspace
	// (with a file the runtime wrote), home and logs before DeleteSession answers.
	s.turn(t, sess.GetSessionId(), "m2", "write: notes.txt kept until deletion")
	require.NotEmpty(t, sandboxLeftovers(t, st.root, sess.GetSandboxId()), "the session's workspace, home and logs exist")
	s.deleteSession(t, sess.GetSessionId())
	require.Empty(t, sandboxLeftovers(t, st.root, sess.GetSandboxId()), "nothing of the deleted session is left on disk")
}
