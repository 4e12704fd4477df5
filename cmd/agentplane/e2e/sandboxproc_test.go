package e2e

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"io"
	"log/slog"
	"net"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/pkg/redistest"
	credential "agentplane.dev/services/credential/server"
	ingest "agentplane.dev/services/ingest/server"
	session "agentplane.dev/services/session/server"
)

// Short sandbox timers for the process-level tests: the reconnect window
// passes in seconds.
const (
	procHeartbeat       = 200 * time.Millisecond
	procDeadAfter       = 1500 * time.Millisecond
	procReconnectWindow = 3 * time.Second
	procOwnerTTL        = 2 * time.Second
)

var (
	sandboxBinOnce sync.Once
	sandboxBin     string
	sandboxBinErr  error
)

// sandboxBinary builds the real sandbox service binary once.
func sandboxBinary(t testing.TB) string {
	sandboxBinOnce.Do(func() {
		dir, err := os.MkdirTemp("", "agentplane-e2e-sandbox-")
		if err != nil {
			sandboxBinErr = err
			return
		}
		sandboxBin = filepath.Join(dir, "sandbox")
		build := exec.Command("go", "build", "-o", sandboxBin, "agentplane.dev/services/sandbox/cmd/sandbox")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		sandboxBinErr = build.Run()
	})
	require.NoError(t, sandboxBinErr, "build the sandbox binary")
	return sandboxBin
}

// sandboxProc is the sandbox service as its own OS process, so a test can
// kill -9 it (no lease release, no stream close, nothing written at exit).
type sandboxProc struct {
	t    testing.TB
	env  []string
	logs string
	cmd  *exec.Cmd
	done chan struct{}
	n    int
}

func (p *sandboxProc) start() {
	p.t.Helper()
	p.n++
	logf, err := os.OpenFile(p.logs, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	require.NoError(p.t, err)
	cmd := exec.Command(sandboxBinary(p.t))
	cmd.Env = append(os.Environ(), p.env...)
	cmd.Env = append(cmd.Env, "AGENTPLANE_SANDBOX_REPLICA=e2e-proc-"+strconv.Itoa(p.n))
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(p.t, cmd.Start())
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); _ = logf.Close(); close(done) }()
	p.cmd, p.done = cmd, done
}

// kill9 kills the service process at once and waits until it is gone.
func (p *sandboxProc) kill9() {
	p.t.Helper()
	require.NoError(p.t, p.cmd.Process.Signal(syscall.SIGKILL))
	<-p.done
}

// stop ends the service with SIGTERM (graceful) and waits.
func (p *sandboxProc) stop() {
	if p.cmd == nil {
		return
	}
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// cutProxy forwards TCP to target until cut: then it drops every
// connection and refuses new ones (the peer is unreachable) until healed.
type cutProxy struct {
	addr  string
	cut   atomic.Bool
	mu    sync.Mutex
	conns map[net.Conn]bool
}

func startCutProxy(t testing.TB, target string) *cutProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{addr: l.Addr().String(), conns: map[net.Conn]bool{}}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = l.Close(); p.dropAll(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			if p.cut.Load() {
				_ = c.Close()
				continue
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns[c], p.conns[s] = true, true
			p.mu.Unlock()
			wg.Go(func() { _, _ = io.Copy(s, c); _ = s.Close(); _ = c.Close() })
			wg.Go(func() { _, _ = io.Copy(c, s); _ = c.Close(); _ = s.Close() })
		}
	})
	return p
}

func (p *cutProxy) dropAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
	p.conns = map[net.Conn]bool{}
}

// setCut cuts (true) or heals (false) the connection.
func (p *cutProxy) setCut(cut bool) {
	p.cut.Store(cut)
	if cut {
		p.dropAll()
	}
}

// startProcSuite is the suite with the sandbox service in its own process
// (session, credential and ingest in this one), on one private redis-server.
// The sandbox reaches the credential service through credCut.
func startProcSuite(t *testing.T) (*suite, *sandboxProc) {
	s, p, _ := startProcSuiteCut(t)
	return s, p
}

func startProcSuiteCut(t *testing.T) (*suite, *sandboxProc, *cutProxy) {
	return startProcSuiteWith(t, procOptions{})
}

// procOptions change the process suite's sandbox service.
type procOptions struct {
	root string   // sandbox root ("": a new directory)
	env  []string // more of the sandbox service's environment
}

func startProcSuiteWith(t *testing.T, o procOptions) (*suite, *sandboxProc, *cutProxy) {
	if o.root == "" {
		o.root = sandboxRoot(t)
	}
	s := &suite{up: &upstream{}, root: o.root, run: newRunID()}
	killProcessesUnder(t, s.root)
	provider := httptest.NewServer(s.up)
	t.Cleanup(provider.Close)
	rs := redistest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())

	credGL, proxyL := listen(t), listen(t)
	sesAddr, ingAddr, sbxAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	s.attKey = make([]byte, 32)
	_, _ = rand.Read(s.attKey)

	ccfg := credential.DefaultConfig()
	ccfg.RedisURL, ccfg.InternalToken, ccfg.DrainDelay, ccfg.MetricsAddr = rs.URL(), token, 0, ""
	ccfg.LogLevel, ccfg.LogFormat = slog.LevelWarn, "json"
	ccfg.CredentialKey = base64.StdEncoding.EncodeToString(key)
	ccfg.AttestationKey = base64.StdEncoding.EncodeToString(s.attKey)
	ccfg.IngestAddr, ccfg.ProviderUpstream = ingAddr, provider.URL

	icfg := ingest.DefaultConfig()
	icfg.RedisURL, icfg.InternalToken, icfg.DrainDelay, icfg.MetricsAddr = rs.URL(), token, 0, ""
	icfg.LogLevel, icfg.LogFormat = slog.LevelWarn, "json"
	icfg.GRPCAddr, icfg.CredentialAddr = ingAddr, credGL.Addr().String()

	scfg := session.DefaultConfig()
	scfg.RedisURL, scfg.InternalToken, scfg.DrainDelay, scfg.MetricsAddr = rs.URL(), token, 0, ""
	scfg.LogLevel, scfg.LogFormat = slog.LevelWarn, "json"
	scfg.GRPCAddr = sesAddr
	scfg.SandboxAddr, scfg.CredentialAddr, scfg.IngestAddr = sbxAddr, credGL.Addr().String(), ingAddr

	done := make(chan error, 3)
	go func() { done <- credential.RunWith(ctx, ccfg, credential.Listeners{GRPC: credGL, Proxy: proxyL}) }()
	go func() { done <- ingest.Run(ctx, icfg) }()
	go func() { done <- session.Run(ctx, scfg) }()
	credCut := startCutProxy(t, credGL.Addr().String())

	p := &sandboxProc{t: t, logs: filepath.Join(t.TempDir(), "sandbox.log"), env: []string{
		"AGENTPLANE_REDIS_URL=" + rs.URL(), "AGENTPLANE_GRPC_ADDR=" + sbxAddr, "AGENTPLANE_METRICS_ADDR=",
		"AGENTPLANE_INTERNAL_TOKEN=" + token, "AGENTPLANE_DRAIN_DELAY=0s", "AGENTPLANE_LOG_FORMAT=json",
		"AGENTPLANE_SESSION_ADDR=" + sesAddr, "AGENTPLANE_CREDENTIAL_ADDR=" + credCut.addr,
		"AGENTPLANE_SANDBOX_PROXY_URL=http://" + proxyL.Addr().String(),
		"AGENTPLANE_SANDBOX_ROOT=" + s.root, "AGENTPLANE_WRAPPER_BIN=" + wrapperBin,
		"AGENTPLANE_SANDBOX_HEARTBEAT=" + procHeartbeat.String(), "AGENTPLANE_SANDBOX_DEAD_AFTER=" + procDeadAfter.String(),
		"AGENTPLANE_SANDBOX_RECONNECT_WINDOW=" + procReconnectWindow.String(), "AGENTPLANE_SANDBOX_OWNER_TTL=" + procOwnerTTL.String(),
	}}
	p.env = append(p.env, o.env...)
	p.start()
	var once sync.Once
	s.stopped = func() {
		once.Do(func() {
			p.stop()
			cancel()
			for range 3 {
				require.NoError(t, <-done)
			}
		})
	}
	t.Cleanup(func() {
		s.stopped()
		if t.Failed() {
			if b, err := os.ReadFile(p.logs); err == nil {
				t.Logf("sandbox service log (last 8 KiB):\n%s", tail(b, 8<<10))
			}
		}
	})
	dial := func(addr string) *grpc.ClientConn {
		c, err := grpcclient.Dial(addr, token)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	s.ses = sessionv1.NewSessionServiceClient(dial(sesAddr))
	s.cred = credentialv1.NewCredentialServiceClient(dial(credGL.Addr().String()))
	s.ing = ingestv1.NewIngestServiceClient(dial(ingAddr))
	return s, p, credCut
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// waitNoWrappers waits until no process of the sandbox runs (after a kill -9
// of the service, the wrappers exit once their reconnect window passed).
func waitNoWrappers(t *testing.T, sandboxID string) {
	t.Helper()
	require.Eventually(t, func() bool { return len(wrapperPIDs(t, sandboxID)) == 0 }, 60*time.Second, 50*time.Millisecond,
		"the wrappers of %s exit after their reconnect window", sandboxID)
}
