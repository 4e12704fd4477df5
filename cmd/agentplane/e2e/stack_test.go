package e2e

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"agentplane.dev/pkg/config"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testaddr"
	"agentplane.dev/pkg/testenv"
	credential "agentplane.dev/services/credential/server"
	ingest "agentplane.dev/services/ingest/server"
	sandbox "agentplane.dev/services/sandbox/server"
	session "agentplane.dev/services/session/server"
)

// The four services a stack runs.
const (
	svcSession    = "session"
	svcSandbox    = "sandbox"
	svcCredential = "credential"
	svcIngest     = "ingest"
)

var allServices = []string{svcCredential, svcIngest, svcSandbox, svcSession}

// stack is the one builder of the four services' wiring every e2e uses: a
// private redis-server, a provider upstream, the keys, a sandbox root and
// each service's settings as the AGENTPLANE_* environment a deployment
// gives it. From that a test runs the services in this process
// (runInProcess: the settings go through each service's LoadConfig) or as
// processes of the agentplane binary (process), or both.
type stack struct {
	t          testing.TB
	rs         *redistest.Server
	up         *upstream
	root       string
	run        string
	attKey     []byte
	addr       map[string]string // gRPC address by service, and "proxy" (host:port)
	metricsURL map[string]string // by service, with stackOptions.metrics
	env        map[string]map[string]string
	// Listeners of the credential gRPC and proxy and of the sandbox service,
	// held (so their ports stay ours) until the services run in this process.
	lis map[string]net.Listener
}

type stackOptions struct {
	logLevel, logFormat string       // default debug, json
	upstream            http.Handler // provider; nil: the recording upstream
	metrics             bool         // every service serves /metrics
	root                string       // sandbox root; "": a new directory
	redisURL            string       // the services' Redis; "": a private redis-server
	minReplicas         int          // every service's REDIS_MIN_REPLICAS
	noToken             bool         // no internal token (a deployment that sets none)
}

func newStack(t testing.TB, o stackOptions) *stack {
	if o.logLevel == "" {
		o.logLevel = "debug"
	}
	if o.logFormat == "" {
		o.logFormat = "json"
	}
	if o.root == "" {
		o.root = testenv.SandboxRoot(t)
	}
	st := &stack{t: t, up: &upstream{}, root: o.root, run: newRunID(),
		addr: map[string]string{}, metricsURL: map[string]string{}, lis: map[string]net.Listener{}}
	killProcessesUnder(t, st.root)
	if o.upstream == nil {
		o.upstream = st.up
	}
	provider := httptest.NewServer(o.upstream)
	t.Cleanup(provider.Close)
	if o.redisURL == "" {
		st.rs = redistest.Start(t)
		o.redisURL = st.rs.URL()
	}

	for _, name := range []string{svcCredential, "proxy", svcSandbox} {
		st.lis[name] = testaddr.Listen(t)
		st.addr[name] = st.lis[name].Addr().String()
	}
	st.addr[svcSession], st.addr[svcIngest] = testaddr.Addr(t), testaddr.Addr(t)
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	st.attKey = make([]byte, 32)
	_, _ = rand.Read(st.attKey)

	st.env = map[string]map[string]string{}
	tok := token
	if o.noToken {
		tok = ""
	}
	for _, svc := range allServices {
		metrics := ""
		if o.metrics {
			metrics = testaddr.Addr(t)
			st.metricsURL[svc] = "http://" + metrics + "/metrics"
		}
		st.env[svc] = map[string]string{
			"REDIS_URL": o.redisURL, "REDIS_MIN_REPLICAS": strconv.Itoa(o.minReplicas), "INTERNAL_TOKEN": tok, "DRAIN_DELAY": "0s", "METRICS_ADDR": metrics,
			"LOG_LEVEL": o.logLevel, "LOG_FORMAT": o.logFormat, "GRPC_ADDR": st.addr[svc],
		}
	}
	st.set(svcCredential, "PROXY_ADDR", st.addr["proxy"], "INGEST_ADDR", st.addr[svcIngest], "PROVIDER_UPSTREAM", provider.URL,
		"SESSION_ADDR", st.addr[svcSession],
		"CREDENTIAL_KEY", base64.StdEncoding.EncodeToString(key), "ATTESTATION_KEY", base64.StdEncoding.EncodeToString(st.attKey),
		"PROXY_GIT_PRIVATE_NETWORKS", "127.0.0.1") // the tests' git http-backend is on loopback
	st.set(svcIngest, "CREDENTIAL_ADDR", st.addr[svcCredential])
	st.set(svcSandbox, "SESSION_ADDR", st.addr[svcSession], "CREDENTIAL_ADDR", st.addr[svcCredential],
		"SANDBOX_PROXY_URL", "http://"+st.addr["proxy"], "SANDBOX_ROOT", st.root, "WRAPPER_BIN", wrapperBin)
	st.set(svcSession, "SANDBOX_ADDR", st.addr[svcSandbox], "CREDENTIAL_ADDR", st.addr[svcCredential], "INGEST_ADDR", st.addr[svcIngest],
		// No idle suspend by default: tests that wait between turns (a
		// failover's lease deadlines under load) check the same wrappers
		// serve after. A test of the suspend sets a session's own
		// suspend_after, which applies whatever the default.
		"SESSION_SUSPEND_AFTER", "0")
	return st
}

// set overrides settings of svc: name, value pairs (names without the
// AGENTPLANE_ prefix).
func (st *stack) set(svc string, kv ...string) {
	for i := 0; i+1 < len(kv); i += 2 {
		st.env[svc][kv[i]] = kv[i+1]
	}
}

// environ is svc's settings with kv over them, as a process environment.
func (st *stack) environ(svc string, kv ...string) []string {
	m := maps.Clone(st.env[svc])
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	env := []string{"PATH=" + os.Getenv("PATH")}
	for _, k := range slices.Sorted(maps.Keys(m)) {
		env = append(env, config.EnvPrefix+k+"="+m[k])
	}
	return env
}

func (st *stack) lookup(svc string) func(string) (string, bool) {
	return func(name string) (string, bool) {
		v, ok := st.env[svc][name[len(config.EnvPrefix):]]
		return v, ok
	}
}

// configs are the four services' configurations, loaded from the stack's
// settings by each service's own LoadConfig.
type configs struct {
	cred credential.Config
	ing  ingest.Config
	sbx  sandbox.Config
	ses  session.Config
}

func (st *stack) configs() *configs {
	var c configs
	var err error
	c.cred, err = credential.LoadConfig(nil, st.lookup(svcCredential))
	require.NoError(st.t, err)
	c.ing, err = ingest.LoadConfig(nil, st.lookup(svcIngest))
	require.NoError(st.t, err)
	c.sbx, err = sandbox.LoadConfig(nil, st.lookup(svcSandbox))
	require.NoError(st.t, err)
	c.ses, err = session.LoadConfig(nil, st.lookup(svcSession))
	require.NoError(st.t, err)
	return &c
}

// releaseListeners frees the held ports of names (all when none) for
// services started on their addresses (processes, services restarted on
// the same address).
func (st *stack) releaseListeners(names ...string) {
	for name, l := range st.lis {
		if len(names) == 0 || slices.Contains(names, name) {
			_ = l.Close()
			delete(st.lis, name)
		}
	}
}

// runInProcess runs the services named in only (all four when none) in this
// process on the held listeners, after tune adjusted their configurations;
// the returned stop (also run at cleanup) ends them and requires a clean exit.
func (st *stack) runInProcess(tune func(*configs), only ...string) (stop func()) {
	if len(only) == 0 {
		only = allServices
	}
	c := st.configs()
	if tune != nil {
		tune(c)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, len(only))
	for _, svc := range only {
		switch svc {
		case svcCredential:
			go func() {
				done <- credential.RunWith(ctx, c.cred, credential.Listeners{GRPC: st.lis[svcCredential], Proxy: st.lis["proxy"]})
			}()
		case svcIngest:
			go func() { done <- ingest.Run(ctx, c.ing) }()
		case svcSandbox:
			go func() { done <- sandbox.RunWith(ctx, c.sbx, sandbox.Listeners{GRPC: st.lis[svcSandbox]}) }()
		case svcSession:
			go func() { done <- session.Run(ctx, c.ses) }()
		}
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			for range only {
				require.NoError(st.t, <-done)
			}
		})
	}
	st.t.Cleanup(stop)
	return stop
}

// dial is a client connection with the internal token, closed at cleanup.
func (st *stack) dial(addr string) *grpc.ClientConn {
	c, err := grpcclient.Dial(addr, token)
	require.NoError(st.t, err)
	st.t.Cleanup(func() { _ = c.Close() })
	return c
}

// suite is the test-facing view of the stack: clients of the session,
// credential and ingest services (at the stack's addresses).
func (st *stack) suite() *suite {
	var rdb *redis.Client
	if st.rs != nil {
		rdb = st.rs.Client(st.t)
	}
	return &suite{
		redis:   rdb,
		ses:     sessionv1.NewSessionServiceClient(st.dial(st.addr[svcSession])),
		sesAddr: st.addr[svcSession],
		cred:    credentialv1.NewCredentialServiceClient(st.dial(st.addr[svcCredential])),
		ing:     ingestv1.NewIngestServiceClient(st.dial(st.addr[svcIngest])),
		sbx:     sandboxv1.NewSandboxServiceClient(st.dial(st.addr[svcSandbox])),
		up:      st.up,
		attKey:  st.attKey,
		root:    st.root,
		proxy:   "http://" + st.addr["proxy"],
		run:     st.run,
		metrics: st.metricsURL,
	}
}

var (
	agentplaneOnce sync.Once
	agentplaneBin  string
	agentplaneErr  error
)

// agentplaneBinary builds the agentplane binary (every service's
// `agentplane <service>`) once per test run.
func agentplaneBinary(t testing.TB) string {
	agentplaneOnce.Do(func() {
		dir, err := os.MkdirTemp("", "agentplane-e2e-services-")
		if err != nil {
			agentplaneErr = err
			return
		}
		agentplaneBin = filepath.Join(dir, "agentplane")
		build := exec.Command("go", "build", "-o", agentplaneBin, "agentplane.dev/cmd/agentplane")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		agentplaneErr = build.Run()
	})
	require.NoError(t, agentplaneErr, "build the agentplane binary")
	return agentplaneBin
}

// proc is one service as its own OS process, so a test can kill -9 it (no
// lease release, no stream close, nothing written at exit) and start it
// again.
type proc struct {
	t             testing.TB
	service, name string
	env           []string
	logs          string
	cmd           *exec.Cmd
	done          chan struct{}
	n             int
}

// process starts svc as process name with the stack's settings and kv over
// them; it is stopped (SIGTERM) at cleanup, and its log's tail is shown when
// the test failed.
func (st *stack) process(svc, name string, kv ...string) *proc {
	p := &proc{t: st.t, service: svc, name: name, env: st.environ(svc, kv...),
		logs: filepath.Join(st.t.TempDir(), name+".log")}
	p.start()
	st.t.Cleanup(func() {
		p.stop()
		if st.t.Failed() {
			if b, err := os.ReadFile(p.logs); err == nil {
				st.t.Logf("%s log (last 8 KiB):\n%s", name, tail(b, 8<<10))
				keepLog(st.t, name, b)
			}
		}
	})
	return p
}

// keepLog copies a failed test's whole service log into
// AGENTPLANE_E2E_LOG_DIR when it is set (the temporary directory goes at
// cleanup), for diagnosing what the 8 KiB tail does not show.
func keepLog(t testing.TB, name string, b []byte) {
	dir := os.Getenv("AGENTPLANE_E2E_LOG_DIR")
	if dir == "" {
		return
	}
	path := filepath.Join(dir, strings.NewReplacer("/", "_").Replace(t.Name())+"-"+name+".log")
	if err := os.MkdirAll(dir, 0o755); err == nil && os.WriteFile(path, b, 0o600) == nil {
		t.Logf("%s log kept at %s", name, path)
	}
}

// start runs the process (again); a sandbox replica restarted is a new
// replica (name-2, name-3, ...) as a restarted pod is.
func (p *proc) start() {
	p.t.Helper()
	p.n++
	logf, err := os.OpenFile(p.logs, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	require.NoError(p.t, err)
	cmd := exec.Command(agentplaneBinary(p.t), "serve", p.service)
	cmd.Env = slices.Clone(p.env)
	if p.service == svcSandbox {
		replica := p.name
		if p.n > 1 {
			replica += "-" + strconv.Itoa(p.n)
		}
		cmd.Env = append(cmd.Env, config.EnvPrefix+"SANDBOX_REPLICA="+replica)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(p.t, cmd.Start())
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); _ = logf.Close(); close(done) }()
	p.cmd, p.done = cmd, done
}

// kill9 kills the process at once and waits until it is gone.
func (p *proc) kill9() {
	p.t.Helper()
	require.NoError(p.t, p.cmd.Process.Signal(syscall.SIGKILL))
	<-p.done
}

func (p *proc) alive() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// stop ends the process with SIGTERM (graceful) and waits.
func (p *proc) stop() {
	if p.cmd == nil || !p.alive() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) String() string { return fmt.Sprintf("%s %s (pid %d)", p.service, p.name, p.pid()) }
