package e2e

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Short sandbox timers for the process-level tests: the reconnect window
// passes in seconds.
const (
	procHeartbeat       = 200 * time.Millisecond
	procDeadAfter       = 1500 * time.Millisecond
	procReconnectWindow = 3 * time.Second
	procOwnerTTL        = 2 * time.Second
)

// cutProxy forwards TCP to target until cut: then it drops every
// connection and refuses new ones (the peer is unreachable) until healed.
type cutProxy struct {
	addr  string
	cut   atomic.Bool
	hold  atomic.Bool // accept, never forward: a call waits for its deadline
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
			if p.hold.Load() {
				p.mu.Lock()
				p.conns[c] = true // closed when the hold ends
				p.mu.Unlock()
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

// setHold makes every connection hang (true: the open ones are dropped,
// new ones accepted and never forwarded, so a call waits for its deadline)
// or heals it (false: the held ones are dropped, so callers dial again).
func (p *cutProxy) setHold(hold bool) {
	p.hold.Store(hold)
	p.dropAll()
}

// startProcSuite is the suite with the sandbox service in its own process
// (session, credential and ingest in this one), on one private redis-server.
// The sandbox reaches the credential service through credCut.
func startProcSuite(t *testing.T) (*suite, *proc) {
	s, p, _ := startProcSuiteCut(t)
	return s, p
}

func startProcSuiteCut(t *testing.T) (*suite, *proc, *cutProxy) {
	return startProcSuiteWith(t, procOptions{})
}

// procOptions change the process suite's sandbox service.
type procOptions struct {
	root string   // sandbox root ("": a new directory)
	env  []string // more of the sandbox service's settings: name, value pairs without the AGENTPLANE_ prefix
}

func startProcSuiteWith(t *testing.T, o procOptions) (*suite, *proc, *cutProxy) {
	st := newStack(t, stackOptions{logLevel: "warn", root: o.root, metrics: true})
	credCut := startCutProxy(t, st.addr[svcCredential])
	st.releaseListeners(svcSandbox) // the sandbox process listens on its address
	stopped := st.runInProcess(nil, svcCredential, svcIngest, svcSession)
	p := st.process(svcSandbox, "e2e-proc", append([]string{"CREDENTIAL_ADDR", credCut.addr,
		"SANDBOX_HEARTBEAT", procHeartbeat.String(), "SANDBOX_DEAD_AFTER", procDeadAfter.String(),
		"SANDBOX_RECONNECT_WINDOW", procReconnectWindow.String(), "SANDBOX_OWNER_TTL", procOwnerTTL.String()}, o.env...)...)
	s := st.suite()
	s.stopped = func() { p.stop(); stopped() }
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
