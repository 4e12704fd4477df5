package egress_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/network/egress"
	"agentplane.dev/services/sandbox/internal/network/egresshandoff"
	"agentplane.dev/services/sandbox/internal/network/socketrelay"
)

// rig is an egress proxy on a Unix socket, a wrapper's egress listener on
// loopback handing connections to it (what a runtime's HTTP(S)_PROXY
// names), and an HTTP and a TLS server the name map points names at.
type rig struct {
	proxyURL *url.URL
	dir      string // the egress socket directory
	plain    *httptest.Server
	tls      *httptest.Server
	mu       sync.Mutex
	policy   egresspolicy.Policy
	audits   []egress.Decision
	seen     int
	clock    time.Time // the budgets' clock; zero: time.Now
	owner    uint64    // the grants' ownership
}

func startRig(t *testing.T, lim egress.Limits, body string) (*rig, func(decision, reason string) float64) {
	return startRigWith(t, lim, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) { _, _ = io.WriteString(w, body+" "+req.Host) }))
}

// startRigWith is startRig with the servers' handler.
func startRigWith(t testing.TB, lim egress.Limits, h http.Handler) (*rig, func(decision, reason string) float64) {
	t.Helper()
	return startRigLedger(t, lim, nil, h)
}

// startRigLedger is startRigWith with a ledger of byte windows.
func startRigLedger(t testing.TB, lim egress.Limits, ledger egress.Ledger, h http.Handler) (*rig, func(decision, reason string) float64) {
	t.Helper()
	r := &rig{}
	r.plain = httptest.NewServer(h)
	r.tls = httptest.NewTLSServer(h)
	t.Cleanup(r.plain.Close)
	t.Cleanup(r.tls.Close)
	lo := netip.MustParseAddr("127.0.0.1")
	decisions := egress.NewDecisions()
	p := egress.New(egress.Config{
		Authorize: func(_ context.Context, id egresshandoff.Identity) (egress.Grant, error) {
			if id.SandboxID != "sb1" {
				return egress.Grant{}, egress.ErrNotOwner // this replica owns sb1 only
			}
			if id.Credential != "cred-1" {
				return egress.Grant{}, errors.New("bad credential")
			}
			r.mu.Lock()
			owner := r.owner
			r.mu.Unlock()
			return egress.Grant{Key: id.SandboxID, Owner: owner, Policy: func() (egresspolicy.Policy, error) {
				r.mu.Lock()
				defer r.mu.Unlock()
				return r.policy, nil
			}, Audit: func(d egress.Decision) {
				r.mu.Lock()
				r.audits = append(r.audits, d)
				r.mu.Unlock()
			}}, nil
		},
		Hosts: map[string][]netip.Addr{
			"allowed.test": {lo}, "denied.test": {lo}, "other.test": {lo},
			"metadata.test": {netip.MustParseAddr("169.254.169.254")}, "private.test": {netip.MustParseAddr("10.255.0.1")},
		},
		Limits: lim, Decisions: decisions, Ledger: ledger,
		Now: func() time.Time {
			r.mu.Lock()
			defer r.mu.Unlock()
			if r.clock.IsZero() {
				return time.Now()
			}
			return r.clock
		},
	})
	dir := t.TempDir()
	r.dir = dir
	ln, err := socketrelay.Listen(filepath.Join(dir, "a.sock"))
	require.NoError(t, err)
	served := make(chan struct{})
	go func() { p.Serve(ln); close(served) }()
	front, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	relayed := make(chan struct{})
	go func() {
		socketrelay.Accept(front, egresshandoff.Handler(dir, egresshandoff.Identity{SandboxID: "sb1", Instance: "i1", Credential: "cred-1"}))
		close(relayed)
	}()
	t.Cleanup(func() { _ = front.Close(); <-relayed; _ = ln.Close(); <-served })
	r.proxyURL = &url.URL{Scheme: "http", Host: front.Addr().String()}
	r.policy = egresspolicy.Policy{Allow: []egresspolicy.Rule{
		{Host: "allowed.test", Ports: []uint32{port(r.plain), port(r.tls)}},
		{Host: "metadata.test", Ports: []uint32{port(r.plain)}}, {Host: "private.test", Ports: []uint32{port(r.plain)}},
	}, PrivateNetworks: []string{"127.0.0.1"}}
	return r, func(decision, reason string) float64 {
		return testutil.ToFloat64(decisions.WithLabelValues(decision, reason))
	}
}

// addReplica starts another replica's proxy on the rig's directory, at
// name, owning no sandbox; it counts its decisions on the returned vector.
func (r *rig) addReplica(t testing.TB, name string) *prometheus.CounterVec {
	t.Helper()
	decisions := egress.NewDecisions()
	p := egress.New(egress.Config{Decisions: decisions, Authorize: func(context.Context, egresshandoff.Identity) (egress.Grant, error) {
		return egress.Grant{}, egress.ErrNotOwner
	}})
	ln, err := socketrelay.Listen(filepath.Join(r.dir, name))
	require.NoError(t, err)
	served := make(chan struct{})
	go func() { p.Serve(ln); close(served) }()
	t.Cleanup(func() { _ = ln.Close(); <-served })
	return decisions
}

func port(s *httptest.Server) uint32 {
	return uint32(s.Listener.Addr().(*net.TCPAddr).Port)
}

func (r *rig) client(serverName string) *http.Client {
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DisableKeepAlives: true, // each request is its own connection, audited when it ends
		Proxy:             http.ProxyURL(r.proxyURL),
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true, ServerName: serverName}, //nolint:gosec // the test's own server
	}}
}

func (r *rig) url(s *httptest.Server, scheme, host string) string {
	return scheme + "://" + host + ":" + strings.Split(s.Listener.Addr().String(), ":")[1] + "/x"
}

// last waits for the audit of the connection just made (an allowed one is
// audited when it ends, after the client saw its answer).
func (r *rig) last() egress.Decision {
	deadline := time.Now().Add(5 * time.Second)
	for {
		r.mu.Lock()
		n := len(r.audits)
		var d egress.Decision
		if n > r.seen {
			d = r.audits[n-1]
			r.seen = n
		}
		r.mu.Unlock()
		if d.Decision != "" || time.Now().After(deadline) {
			return d
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func get(t *testing.T, c *http.Client, u string) (int, string, error) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

func TestEgressDecisions(t *testing.T) {
	r, metric := startRig(t, egress.Limits{MaxConns: 8, Idle: time.Minute}, "hello")

	code, body, err := get(t, r.client(""), r.url(r.plain, "http", "allowed.test"))
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "hello allowed.test:")
	d := r.last()
	require.Equal(t, egress.Allowed, d.Decision)
	require.Equal(t, "http", d.Kind)
	require.Positive(t, d.BytesDown)

	code, body, err = get(t, r.client(""), r.url(r.tls, "https", "allowed.test"))
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "hello allowed.test:")
	d = r.last()
	require.Equal(t, egress.Decision{Kind: "connect", Host: "allowed.test", Port: int(port(r.tls)), Decision: egress.Allowed,
		Reason: egress.ReasonPolicy, BytesUp: d.BytesUp, BytesDown: d.BytesDown}, d)
	require.Positive(t, d.BytesUp)
	require.InDelta(t, 2.0, metric(egress.Allowed, egress.ReasonPolicy), 0)

	for _, c := range []struct {
		name, url, reason string
		code              int
	}{
		{"denied name", r.url(r.plain, "http", "denied.test"), egress.ReasonNotAllowed, 403},
		{"denied name over TLS", r.url(r.tls, "https", "denied.test"), egress.ReasonNotAllowed, 403},
		{"raw IP", r.url(r.plain, "http", "127.0.0.1"), egress.ReasonIPLiteral, 403},
		{"raw IP over TLS", r.url(r.tls, "https", "127.0.0.1"), egress.ReasonIPLiteral, 403},
		{"metadata address", r.url(r.plain, "http", "metadata.test"), egress.ReasonPrivateAddress, 403},
		{"private address", r.url(r.plain, "http", "private.test"), egress.ReasonPrivateAddress, 403},
		{"allowed name, other port", "http://allowed.test:1/x", egress.ReasonNotAllowed, 403},
	} {
		before := metric(egress.Denied, c.reason)
		code, body, err := get(t, r.client(""), c.url)
		if strings.HasPrefix(c.url, "https") {
			require.Error(t, err, c.name) // the tunnel was refused
		} else {
			require.NoError(t, err, c.name)
			require.Equal(t, c.code, code, c.name)
			require.Contains(t, body, c.reason, c.name)
		}
		d := r.last()
		require.Equal(t, c.reason, d.Reason, c.name)
		require.Equal(t, egress.Denied, d.Decision, c.name)
		require.InDelta(t, before+1, metric(egress.Denied, c.reason), 0, c.name)
	}

	// CONNECT allowed.test with a ClientHello for other.test.
	_, _, err = get(t, r.client("other.test"), r.url(r.tls, "https", "allowed.test"))
	require.Error(t, err)
	require.Equal(t, egress.ReasonSNIMismatch, r.last().Reason)
	require.InDelta(t, 1.0, metric(egress.Denied, egress.ReasonSNIMismatch), 0)

	// CONNECT then plain text.
	conn, err := net.Dial("tcp", r.proxyURL.Host)
	require.NoError(t, err)
	_, _ = io.WriteString(conn, "CONNECT allowed.test:"+strings.Split(r.tls.Listener.Addr().String(), ":")[1]+" HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\n\r\n")
	_, _ = io.ReadAll(conn)
	_ = conn.Close()
	require.Equal(t, egress.ReasonNotTLS, r.last().Reason)

	// A change applies to the next connection.
	r.mu.Lock()
	r.policy.Allow = r.policy.Allow[1:]
	r.mu.Unlock()
	code, _, err = get(t, r.client(""), r.url(r.plain, "http", "allowed.test"))
	require.NoError(t, err)
	require.Equal(t, http.StatusForbidden, code)
}

func TestEgressBounds(t *testing.T) {
	r, metric := startRig(t, egress.Limits{MaxConns: 1, Idle: 200 * time.Millisecond}, "hello")

	// Idle and the connection count: one tunnel held open and silent.
	conn := connect(t, r, r.tls)
	defer conn.Close()
	code, _, err := get(t, r.client(""), r.url(r.plain, "http", "allowed.test"))
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, code, "the second connection of the sandbox")
	require.InDelta(t, 1.0, metric(egress.Denied, egress.ReasonConnectionLimit), 0)
	_, _ = io.ReadAll(conn) // the proxy closes the silent tunnel
	require.Eventually(t, func() bool { return metric(egress.Closed, egress.ReasonIdleTimeout) == 1 }, 5*time.Second, 10*time.Millisecond)
}

// connect opens a CONNECT tunnel to allowed.test on s's port and reads the
// proxy's 200.
func connect(t *testing.T, r *rig, s *httptest.Server) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", r.proxyURL.Host)
	require.NoError(t, err)
	target := "allowed.test:" + strconv.Itoa(int(port(s)))
	_, err = io.WriteString(conn, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
	require.NoError(t, err)
	buf := make([]byte, 64)
	n, err := conn.Read(buf)
	require.NoError(t, err)
	require.Contains(t, string(buf[:n]), "200")
	return conn
}

// The byte bound is the sandbox's, over all its connections in a window:
// a download within it, then one that would pass it is cut at it; a
// tunnel open meanwhile is cut at its next byte; a new connection is
// refused until the window ends, and the next window starts at zero.
func TestEgressBytesPerSandbox(t *testing.T) {
	const allowance = 64 << 10
	r, metric := startRigWith(t, egress.Limits{MaxConns: 8, MaxBytes: allowance, BytesWindow: time.Hour, Idle: time.Minute},
		http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			n, _ := strconv.Atoi(req.URL.Query().Get("n"))
			_, _ = io.WriteString(w, strings.Repeat("x", n))
		}))
	r.mu.Lock()
	r.clock = time.Unix(1_000_000, 0)
	r.mu.Unlock()
	tunnel := tls.Client(connect(t, r, r.tls), &tls.Config{InsecureSkipVerify: true, ServerName: "allowed.test"}) //nolint:gosec // the test's own server
	defer func() { _ = tunnel.Close() }()
	require.NoError(t, tunnel.Handshake())

	code, body, err := get(t, r.client(""), r.url(r.plain, "http", "allowed.test")+"?n=20000")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Len(t, body, 20000)
	first := r.last()
	require.Equal(t, egress.Allowed, first.Decision, "%+v", first)

	_, body, err = get(t, r.client(""), r.url(r.plain, "http", "allowed.test")+"?n=1000000")
	if err == nil {
		require.Less(t, len(body), 1000000)
	}
	second := r.last()
	require.Equal(t, egress.Decision{Kind: "http", Host: "allowed.test", Port: int(port(r.plain)), Decision: egress.Closed,
		Reason: egress.ReasonBytesLimit, BytesUp: second.BytesUp, BytesDown: second.BytesDown}, second)
	require.Less(t, first.BytesUp+first.BytesDown+second.BytesUp+second.BytesDown, int64(allowance),
		"the tunnel's handshake counts too")
	require.InDelta(t, 1.0, metric(egress.Closed, egress.ReasonBytesLimit), 0)

	// The open tunnel: its next byte is past the allowance.
	_, _ = io.WriteString(tunnel, "GET /x?n=10 HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
	_, err = io.ReadAll(tunnel)
	require.Error(t, err, "cut: no close_notify")
	cut := r.last()
	require.Equal(t, [2]string{egress.Closed, egress.ReasonBytesLimit}, [2]string{cut.Decision, cut.Reason}, "%+v", cut)
	require.Equal(t, "connect", cut.Kind)
	require.LessOrEqual(t, first.BytesUp+first.BytesDown+second.BytesUp+second.BytesDown+cut.BytesUp+cut.BytesDown, int64(allowance)+2,
		"crossed by a byte per connection, not a buffer")
	require.InDelta(t, 2.0, metric(egress.Closed, egress.ReasonBytesLimit), 0)

	code, body, err = get(t, r.client(""), r.url(r.plain, "http", "allowed.test")+"?n=10")
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "denied (bytes_limit)")
	denied := r.last()
	require.Equal(t, [2]string{egress.Denied, egress.ReasonBytesLimit}, [2]string{denied.Decision, denied.Reason})
	require.InDelta(t, 1.0, metric(egress.Denied, egress.ReasonBytesLimit), 0)

	r.mu.Lock()
	r.clock = r.clock.Add(time.Hour)
	r.mu.Unlock()
	code, body, err = get(t, r.client(""), r.url(r.plain, "http", "allowed.test")+"?n=20000")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code, "a new window")
	require.Len(t, body, 20000)
}

// memLedger is a Ledger in memory: the proxy's use of one, unit-tested
// (the sandbox store's, on Redis, in e2e.TestEgressByteWindowOutlivesItsOwner).
type memLedger struct {
	mu      sync.Mutex
	windows map[string]egress.Window
	loadErr error
}

func (l *memLedger) Load(_ context.Context, key string) (egress.Window, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.windows[key], l.loadErr
}

func (l *memLedger) Save(_ context.Context, key string, w egress.Window, _ time.Time) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.windows[key] = w
	return nil
}

func (l *memLedger) get(key string) egress.Window {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.windows[key]
}

func (l *memLedger) set(key string, w egress.Window, loadErr error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.windows[key], l.loadErr = w, loadErr
}

// A sandbox's byte window outlives the proxy that counted it: the
// connection that crossed the allowance is saved before the runtime sees
// it end, so a restarted proxy (or the next owner) refuses the next one
// until the window ends. A grant under a new ownership reads the window
// again; a window that cannot be read refuses the connection rather than
// granting a fresh allowance.
func TestEgressByteWindowOutlivesTheProxy(t *testing.T) {
	const allowance = 64 << 10
	lim := egress.Limits{MaxConns: 8, MaxBytes: allowance, BytesWindow: time.Hour, Idle: time.Minute}
	h := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		n, _ := strconv.Atoi(req.URL.Query().Get("n"))
		_, _ = io.WriteString(w, strings.Repeat("x", n))
	})
	ledger := &memLedger{windows: map[string]egress.Window{}}
	first, _ := startRigLedger(t, lim, ledger, h)
	_, _, err := get(t, first.client(""), first.url(first.plain, "http", "allowed.test")+"?n=1000000")
	if err == nil {
		require.Equal(t, egress.ReasonBytesLimit, first.last().Reason, "cut at the allowance")
	}
	saved := ledger.get("sb1")
	require.Greater(t, saved.Used, int64(allowance), "saved before the runtime saw the cut")
	require.False(t, saved.Start.IsZero())

	restarted, metric := startRigLedger(t, lim, ledger, h)
	code, body, err := get(t, restarted.client(""), restarted.url(restarted.plain, "http", "allowed.test")+"?n=10")
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "denied (bytes_limit)")
	require.InDelta(t, 1.0, metric(egress.Denied, egress.ReasonBytesLimit), 0)

	// Another owner's window (here: a new one, nothing carried) is read
	// under the next ownership, not the one this proxy kept.
	ledger.set("sb1", egress.Window{Start: time.Now(), Used: 0}, nil)
	small := func() (int, string) {
		code, body, err := get(t, restarted.client(""), restarted.url(restarted.plain, "http", "allowed.test")+"?n=10")
		require.NoError(t, err)
		return code, body
	}
	nextOwner := func() {
		restarted.mu.Lock()
		restarted.owner++
		restarted.mu.Unlock()
	}
	code, _ = small()
	require.Equal(t, http.StatusServiceUnavailable, code, "same ownership: the proxy's own count")
	nextOwner()
	code, body = small()
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "xxxxxxxxxx", body)
	require.Eventually(t, func() bool { return ledger.get("sb1").Used > 0 }, 5*time.Second, time.Millisecond,
		"and saved on, as the connection ends (the client saw its whole answer before)")

	ledger.set("sb1", egress.Window{}, errors.New("store down"))
	nextOwner()
	code, body = small()
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "denied (bytes_unavailable)")
	require.InDelta(t, 1.0, metric(egress.Denied, egress.ReasonBytesUnavailable), 0)
}

// countingConn counts the bytes the runtime's side wrote and read.
type countingConn struct {
	net.Conn
	wrote, read int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.wrote += int64(n)
	return n, err
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read += int64(n)
	return n, err
}

// requireAnswer: raw is an HTTP response whose body starts with body.
func requireAnswer(t *testing.T, raw []byte, body string) {
	t.Helper()
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw)), nil)
	require.NoError(t, err)
	got, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(string(got), body), "the whole answer, %d bytes", len(got))
}

// The audit's byte counts are the bytes the runtime sent and received,
// exactly, both ways, on the counted copy paths (a plain-HTTP
// download and both directions of a CONNECT tunnel).
func TestEgressCountsEveryByte(t *testing.T) {
	big := strings.Repeat("y", 3<<20+17)
	r, _ := startRigWith(t, egress.Limits{MaxConns: 8, Idle: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body) // all of an upload, so the server closes without a reset
		_, _ = io.WriteString(w, big)
	}))
	dial := func() *countingConn {
		c, err := net.Dial("tcp", r.proxyURL.Host)
		require.NoError(t, err)
		return &countingConn{Conn: c}
	}

	c := dial()
	_, err := io.WriteString(c, "GET "+r.url(r.plain, "http", "allowed.test")+" HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
	require.NoError(t, err)
	b, err := io.ReadAll(c)
	require.NoError(t, err)
	requireAnswer(t, b, big)
	_ = c.Close()
	d := r.last()
	require.Equal(t, egress.Allowed, d.Decision, "%+v", d)
	require.Equal(t, [2]int64{c.wrote, c.read}, [2]int64{d.BytesUp, d.BytesDown})

	c = dial()
	target := "allowed.test:" + strconv.Itoa(int(port(r.tls)))
	_, err = io.WriteString(c, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
	require.NoError(t, err)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Zero(t, br.Buffered())
	tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true, ServerName: "allowed.test"}) //nolint:gosec // the test's own server
	upload := strings.Repeat("z", 2<<20+5)
	_, err = io.WriteString(tc, "POST /x HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\nContent-Length: "+strconv.Itoa(len(upload))+"\r\n\r\n"+upload)
	require.NoError(t, err)
	b, err = io.ReadAll(tc)
	require.NoError(t, err)
	requireAnswer(t, b, big)
	_ = c.Close() // not tc: its close_notify would race the count
	d = r.last()
	require.Equal(t, egress.Allowed, d.Decision, "%+v", d)
	require.Equal(t, [2]int64{c.wrote, c.read}, [2]int64{d.BytesUp, d.BytesDown})
}

func TestEgressRefusesAnUnauthenticatedConnection(t *testing.T) {
	dir := t.TempDir()
	decisions := egress.NewDecisions()
	p := egress.New(egress.Config{Decisions: decisions, Authorize: func(context.Context, egresshandoff.Identity) (egress.Grant, error) {
		return egress.Grant{}, errors.New("no")
	}})
	ln, err := socketrelay.Listen(filepath.Join(dir, "a.sock"))
	require.NoError(t, err)
	go p.Serve(ln)
	defer ln.Close()
	for _, pre := range []string{"GET http://allowed.test/ HTTP/1.1\r\n\r\n", "AGENTPLANE-EGRESS/1 sb i Y3JlZA\nGET http://a.test/ HTTP/1.1\r\n\r\n"} {
		c, err := net.Dial("unix", filepath.Join(dir, "a.sock"))
		require.NoError(t, err)
		_, _ = io.WriteString(c, pre)
		b, _ := io.ReadAll(c)
		_ = c.Close()
		require.NotContains(t, string(b), "200")
	}
	require.InDelta(t, 2.0, testutil.ToFloat64(decisions.WithLabelValues(egress.Denied, egress.ReasonUnauthenticated)), 0)
}
