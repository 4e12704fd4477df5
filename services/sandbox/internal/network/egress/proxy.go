// Package egress is the sandbox's way out to the internet, by policy: an
// HTTP proxy outside the boundary to which a wrapper inside hands each of
// its runtime's connections, through a Unix socket bound into the sandbox
// (handoff.go). It serves CONNECT (TLS
// only: the ClientHello's SNI must be the CONNECT host) and plain-HTTP
// requests, allows a destination only when the policy of the connection's
// wrapper names its host and port, resolves names itself (a resolution
// from inside is never trusted), dials only addresses the policy allows
// (no private, loopback, link-local or metadata address unless named), and
// bounds each sandbox's connections, bytes and idle time. Every decision is
// counted and handed to the wrapper's audit.
package egress

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/network/egresshandoff"
)

// Decisions.
const (
	Allowed = "allowed"
	Denied  = "denied"
	Closed  = "closed" // an allowed connection cut by a bound
)

// Reasons: a bounded set (they are metric labels).
const (
	ReasonPolicy            = "policy"             // allowed by a rule
	ReasonNotAllowed        = "not_allowed"        // no rule names the host and port
	ReasonIPLiteral         = "ip_literal"         // an address instead of a name
	ReasonBadRequest        = "bad_request"        // not a proxy request egress serves
	ReasonPrivateAddress    = "private_address"    // the name resolves only to refused addresses
	ReasonResolveFailed     = "resolve_failed"     // the name does not resolve
	ReasonConnectFailed     = "connect_failed"     // no allowed address answers
	ReasonNotTLS            = "not_tls"            // a CONNECT tunnel that does not start with a ClientHello
	ReasonSNIMismatch       = "sni_mismatch"       // the ClientHello names another host (or none)
	ReasonConnectionLimit   = "connection_limit"   // the sandbox has its maximum of open connections
	ReasonUnauthenticated   = "unauthenticated"    // no valid wrapper preamble
	ReasonPolicyUnavailable = "policy_unavailable" // the wrapper's policy cannot be read now
	ReasonBytesLimit        = "bytes_limit"        // the sandbox's connections carried the window's allowance
	ReasonBytesUnavailable  = "bytes_unavailable"  // the sandbox's saved byte window cannot be read now
	ReasonIdleTimeout       = "idle_timeout"       // closed: nothing moved for the idle bound
	// ReasonRequestLineTooLong (414) and ReasonHeadersTooLarge (431): the
	// request head is past its bounds (head.go).
	ReasonRequestLineTooLong = "request_line_too_long"
	ReasonHeadersTooLarge    = "headers_too_large"
)

// decisionReasons are every (decision, reason) pair, shown at zero from the
// start.
var decisionReasons = [][2]string{
	{Allowed, ReasonPolicy},
	{Denied, ReasonNotAllowed}, {Denied, ReasonIPLiteral}, {Denied, ReasonBadRequest}, {Denied, ReasonPrivateAddress},
	{Denied, ReasonResolveFailed}, {Denied, ReasonConnectFailed}, {Denied, ReasonNotTLS}, {Denied, ReasonSNIMismatch},
	{Denied, ReasonConnectionLimit}, {Denied, ReasonBytesLimit}, {Denied, ReasonBytesUnavailable},
	{Denied, ReasonUnauthenticated}, {Denied, ReasonPolicyUnavailable},
	{Denied, ReasonRequestLineTooLong}, {Denied, ReasonHeadersTooLarge},
	{Closed, ReasonBytesLimit}, {Closed, ReasonIdleTimeout},
}

// NewDecisions is the decisions counter, every pair at zero.
func NewDecisions() *prometheus.CounterVec {
	v := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentplane_sandbox_egress_decisions_total",
		Help: "Egress proxy decisions by decision (allowed, denied, closed: an allowed connection cut by a bound) and reason (docs/sandbox.md).",
	}, []string{"decision", "reason"})
	for _, p := range decisionReasons {
		v.WithLabelValues(p[0], p[1])
	}
	return v
}

// Decision is one audited decision: a connection (CONNECT) or a request
// (plain HTTP), with the bytes it carried each way.
type Decision struct {
	Kind      string // "connect" or "http"
	Host      string
	Port      int
	Decision  string
	Reason    string
	BytesUp   int64 // from the sandbox
	BytesDown int64 // to the sandbox
}

// Grant is what an authenticated wrapper's connections work with.
type Grant struct {
	// Key is what the bounds count against (the sandbox).
	Key string
	// Owner is the ownership the grant was made under (the owner token):
	// a byte window kept from another is read from the Ledger again.
	Owner uint64
	// Policy returns the wrapper's policy as it is now (read per request,
	// so a change applies to the next connection).
	Policy func() (egresspolicy.Policy, error)
	// Audit receives every decision of the connection.
	Audit func(Decision)
}

// Authorizer checks a connection's preamble.
type Authorizer func(ctx context.Context, id egresshandoff.Identity) (Grant, error)

// ErrNotOwner is what an Authorizer returns for a wrapper whose sandbox
// another replica owns (or none does): the proxy answers
// egresshandoff.AnswerNotOwner and leaves the runtime's connection to the next
// replica.
var ErrNotOwner = errors.New("egress: the wrapper's sandbox is not owned here")

// Limits bound each sandbox (0: unbounded).
type Limits struct {
	MaxConns int   // open connections per sandbox
	MaxBytes int64 // bytes of all the sandbox's connections, both ways together, per BytesWindow
	// BytesWindow is the window of MaxBytes: one starts with the sandbox's
	// first connection (or byte) after the previous one ended.
	BytesWindow time.Duration
	Idle        time.Duration // a connection with nothing moving this long is closed
}

// Config configures a Proxy.
type Config struct {
	Authorize Authorizer
	// Default is the deployment's policy, in force besides every wrapper's.
	Default egresspolicy.Policy
	// Hosts answer names before DNS (a static name map; tests use it as
	// their DNS).
	Hosts    map[string][]netip.Addr
	Resolver *net.Resolver // nil: net.DefaultResolver
	Limits   Limits
	// Decisions counts decisions; nil: not counted.
	Decisions *prometheus.CounterVec
	Log       *slog.Logger
	// Now is the budgets' clock; nil: time.Now.
	Now func() time.Time
	// Ledger keeps each sandbox's byte window beyond this process; nil:
	// the window lives and dies with it.
	Ledger Ledger
}

// Ledger keeps each sandbox's byte window where its next owner finds it,
// so a restart or a takeover goes on counting instead of granting a fresh
// allowance. Save is fenced by the owner: a former owner's fails.
type Ledger interface {
	Load(ctx context.Context, key string) (Window, error)
	Save(ctx context.Context, key string, w Window, ends time.Time) error
}

// Window is a sandbox's byte window: when it started, what it carried.
type Window struct {
	Start time.Time
	Used  int64
}

// Proxy is the egress proxy.
type Proxy struct {
	cfg  Config
	dial net.Dialer
	mu   sync.Mutex
	// budgets are the sandboxes' bounds: of every sandbox with an open
	// connection or a window not yet ended.
	budgets map[string]*budget
	// live are the connections being served, closed when Serve ends.
	live    map[io.Closer]bool
	closing bool
}

// Timeouts of the steps before bytes flow.
const (
	headerTimeout  = egresshandoff.Timeout
	resolveTimeout = 5 * time.Second
	dialTimeout    = 10 * time.Second
)

// New returns a proxy.
func New(cfg Config) *Proxy {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Proxy{cfg: cfg, dial: net.Dialer{Timeout: dialTimeout}, budgets: map[string]*budget{}, live: map[io.Closer]bool{}}
}

// Serve accepts handoffs on ln until it is closed; it returns once every
// connection it served has ended (closing ln closes them).
func (p *Proxy) Serve(ln net.Listener) {
	var wg sync.WaitGroup
	stopSaving := make(chan struct{})
	saving := make(chan struct{})
	go func() {
		defer close(saving)
		t := time.NewTicker(saveEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				p.saveWindows()
			case <-stopSaving:
				return
			}
		}
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			break
		}
		wg.Go(func() { p.handle(c) })
	}
	p.mu.Lock()
	p.closing = true
	for c := range p.live {
		_ = c.Close()
	}
	p.mu.Unlock()
	wg.Wait()
	close(stopSaving)
	<-saving
	p.saveWindows()
}

// track makes Serve's end close c until the returned func is called; a c
// that comes after that end is closed at once.
func (p *Proxy) track(c io.Closer) (untrack func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closing {
		_ = c.Close()
	}
	p.live[c] = true
	return func() {
		p.mu.Lock()
		delete(p.live, c)
		p.mu.Unlock()
	}
}

func (p *Proxy) count(decision, reason string) {
	if p.cfg.Decisions != nil {
		p.cfg.Decisions.WithLabelValues(decision, reason).Inc()
	}
}

func (p *Proxy) record(g Grant, d Decision) {
	p.count(d.Decision, d.Reason)
	if g.Audit != nil {
		g.Audit(d)
	}
}

// acquire opens a connection on the sandbox's budget, or says which bound
// refuses it.
func (p *Proxy) acquire(g Grant) (*budget, string) {
	b, err := p.budget(g)
	if err != nil {
		p.cfg.Log.Warn("egress connection refused: the sandbox's byte window cannot be read", "sandbox", g.Key, "err", err)
		return nil, ReasonBytesUnavailable
	}
	// b counts this connection already (budget took it under p.mu, so no
	// sweep saw it idle); a refusal gives it back.
	refused := ""
	if b.spent() {
		refused = ReasonBytesLimit
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if refused == "" && p.cfg.Limits.MaxConns > 0 && b.open > p.cfg.Limits.MaxConns {
		refused = ReasonConnectionLimit
	}
	if refused != "" {
		b.open--
		return nil, refused
	}
	return b, ""
}

// budget is g's sandbox's budget, with one more connection counted open
// on it: the one in memory when it was made under g's ownership, else a
// new one that goes on from the Ledger's window. Budgets that hold
// nothing any more go first. The count is taken under p.mu, with the
// lookup: a budget found or made here is never swept as idle before its
// connection counts (two budgets for one sandbox would each grant the
// whole allowance).
func (p *Proxy) budget(g Grant) (*budget, error) {
	p.mu.Lock()
	for k, b := range p.budgets {
		if b.idle() {
			delete(p.budgets, k)
		}
	}
	if b := p.budgets[g.Key]; b != nil && b.owner == g.Owner {
		b.hold()
		p.mu.Unlock()
		return b, nil
	}
	p.mu.Unlock()
	b := &budget{max: p.cfg.Limits.MaxBytes, window: p.cfg.Limits.BytesWindow, now: p.cfg.Now, owner: g.Owner, key: g.Key}
	if p.cfg.Ledger != nil && b.max > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), headerTimeout)
		w, err := p.cfg.Ledger.Load(ctx, g.Key)
		cancel()
		if err != nil {
			return nil, err
		}
		b.resume(w)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if cur := p.budgets[g.Key]; cur != nil && cur.owner == g.Owner {
		b = cur // another connection loaded it meanwhile
	} else {
		p.budgets[g.Key] = b
	}
	b.hold()
	return b, nil
}

// saveEvery is how often the windows of open connections are saved: what
// a crash can lose of a window's count is what moved since.
const saveEvery = time.Second

// saveWindows saves every budget's window that changed since its last
// save; a failed save is tried again at the next.
func (p *Proxy) saveWindows() {
	p.mu.Lock()
	bs := make([]*budget, 0, len(p.budgets))
	for _, b := range p.budgets {
		bs = append(bs, b)
	}
	p.mu.Unlock()
	for _, b := range bs {
		p.saveWindow(b)
	}
}

func (p *Proxy) saveWindow(b *budget) {
	if p.cfg.Ledger == nil {
		return
	}
	w, ends, changed := b.unsaved()
	if !changed {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), headerTimeout)
	err := p.cfg.Ledger.Save(ctx, b.key, w, ends)
	cancel()
	if err != nil {
		p.cfg.Log.Warn("egress byte window not saved", "sandbox", b.key, "err", err)
		return
	}
	b.markSaved(w)
}

// release closes a connection on b, saving the window first: a runtime
// that sees its connection end finds what it carried counted by the next
// owner too.
func (p *Proxy) release(b *budget) {
	p.saveWindow(b)
	b.mu.Lock()
	b.open--
	b.mu.Unlock()
}

// handle serves one handoff: the runtime's connection, once its wrapper
// authenticated, serves one request (CONNECT or plain HTTP; every answer
// closes the connection, so each connection is decided on the policy
// current when it was opened).
func (p *Proxy) handle(c net.Conn) {
	defer c.Close() // a bounded listener's connection frees its peer's slot (relay.Bound)
	if w, ok := c.(interface{ NetConn() net.Conn }); ok {
		c = w.NetConn()
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return
	}
	id, client, g, err := p.take(uc)
	if client == nil {
		return
	}
	defer p.track(client)()
	defer func() { _ = client.Close() }()
	// Until bytes flow, both ways: a runtime that neither sends its
	// request nor reads an answer does not hold a connection for long.
	_ = client.SetDeadline(time.Now().Add(headerTimeout))
	if err != nil {
		p.count(Denied, ReasonUnauthenticated)
		p.cfg.Log.Warn("egress connection refused: the wrapper did not authenticate", "sandbox", id.SandboxID, "instance", id.Instance, "err", err)
		egresshandoff.WriteDenied(client, http.StatusProxyAuthRequired, ReasonUnauthenticated)
		return
	}
	b, refused := p.acquire(g)
	if refused != "" {
		m := newMeter(client, &budget{}, 0, nil) // counted for the audit only
		d, _, _, _ := readRequest(newHeadReader(m))
		p.deny(g, m, d, http.StatusServiceUnavailable, refused)
		return
	}
	defer p.release(b)
	m := newMeter(client, b, p.cfg.Limits.Idle, func() { p.saveWindow(b) })
	defer m.stop()
	p.serve(g, m)
}

// take receives the handoff on uc, authorizes its wrapper and answers it,
// then closes uc. client nil: nothing for this replica to serve (a refused
// handoff, counted; another replica's wrapper, told so). Else this replica
// decides client: a Grant, or the reason the wrapper did not authenticate.
func (p *Proxy) take(uc *net.UnixConn) (egresshandoff.Identity, *net.TCPConn, Grant, error) {
	defer p.track(uc)()
	defer func() { _ = uc.Close() }()
	id, client, err := egresshandoff.Receive(uc)
	if errors.Is(err, egresshandoff.ErrNothing) {
		return egresshandoff.Identity{}, nil, Grant{}, nil
	}
	if err != nil {
		p.count(Denied, ReasonUnauthenticated)
		p.cfg.Log.Warn("egress handoff refused: not one preamble with one connected TCP socket", "err", err)
		return egresshandoff.Identity{}, nil, Grant{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), headerTimeout)
	g, err := p.cfg.Authorize(ctx, id)
	cancel()
	_ = uc.SetWriteDeadline(time.Now().Add(headerTimeout))
	if errors.Is(err, ErrNotOwner) {
		// The wrapper still holds the socket: closing this copy sends
		// nothing to the runtime.
		_ = client.Close()
		_, _ = uc.Write([]byte{egresshandoff.AnswerNotOwner})
		return egresshandoff.Identity{}, nil, Grant{}, nil
	}
	_, _ = uc.Write([]byte{egresshandoff.AnswerAccepted}) // a wrapper gone meanwhile changes nothing: this replica decides
	return id, client, g, err
}

// readRequest reads the runtime's request and names its destination, or
// says why it has none (req nil: nothing to answer unless code is set: a
// head past its bounds).
func readRequest(br headReader) (d Decision, req *http.Request, code int, reason string) {
	req, code, reason = br.readHead()
	if req == nil {
		return Decision{Kind: "http"}, nil, code, reason
	}
	d = Decision{Kind: "http"}
	if req.Method == http.MethodConnect {
		d.Kind = "connect"
	}
	d.Host, d.Port, reason = target(req)
	return d, req, 0, reason
}

// serve decides m's request and, when allowed, carries it.
func (p *Proxy) serve(g Grant, m *meter) {
	br := newHeadReader(m)
	d, req, code, reason := readRequest(br)
	if req == nil {
		if code != 0 {
			p.deny(g, m, d, code, reason)
		}
		return
	}
	if reason != "" {
		p.deny(g, m, d, http.StatusForbidden, reason)
		return
	}
	pol, err := p.policy(g)
	if err != nil {
		p.deny(g, m, d, http.StatusServiceUnavailable, ReasonPolicyUnavailable)
		return
	}
	if !pol.Allows(d.Host, d.Port) {
		p.deny(g, m, d, http.StatusForbidden, ReasonNotAllowed)
		return
	}
	up, reason := p.connect(pol, d.Host, d.Port)
	if reason != "" {
		code := http.StatusBadGateway
		if reason == ReasonPrivateAddress {
			code = http.StatusForbidden
		}
		p.deny(g, m, d, code, reason)
		return
	}
	m.alsoClose(up)
	defer up.Close()
	if d.Kind == "connect" {
		p.tunnel(g, m, br.Reader, up, d)
		return
	}
	p.forward(g, m, req, up, d)
}

func (p *Proxy) policy(g Grant) (egresspolicy.Policy, error) {
	own, err := g.Policy()
	if err != nil {
		return egresspolicy.Policy{}, err
	}
	return egresspolicy.Union(p.cfg.Default, own), nil
}

func (p *Proxy) deny(g Grant, m *meter, d Decision, code int, reason string) {
	d.Decision, d.Reason = Denied, reason
	d.BytesUp, d.BytesDown = m.counts()
	p.record(g, d)
	egresshandoff.WriteDenied(m, code, reason)
}

// finish records an allowed connection once it ended: allowed, or closed
// with the bound that cut it.
func (p *Proxy) finish(g Grant, m *meter, d Decision) {
	d.Decision, d.Reason = Allowed, ReasonPolicy
	if r := m.cutReason(); r != "" {
		p.count(Allowed, ReasonPolicy) // it was allowed before a bound cut it
		d.Decision, d.Reason = Closed, r
	}
	d.BytesUp, d.BytesDown = m.counts()
	p.record(g, d)
}

// target is the request's destination: a normalized name and a port, or
// why not.
func target(req *http.Request) (host string, port int, reason string) {
	authority := req.Host
	if req.Method != http.MethodConnect {
		if req.URL == nil || !req.URL.IsAbs() || req.URL.Scheme != "http" {
			return "", 0, ReasonBadRequest // https goes through CONNECT
		}
		authority = req.URL.Host
	}
	h, ps, err := net.SplitHostPort(authority)
	if err != nil {
		if req.Method == http.MethodConnect {
			return "", 0, ReasonBadRequest
		}
		h, ps = authority, "80"
	}
	n, err := strconv.Atoi(ps)
	if err != nil || n < 1 || n > 65535 {
		return "", 0, ReasonBadRequest
	}
	if _, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
		return h, n, ReasonIPLiteral
	}
	name, ok := egresspolicy.NormalizeHost(h)
	if !ok {
		return "", n, ReasonBadRequest
	}
	return name, n, ""
}

// connect resolves host itself, keeps the addresses pol allows and dials
// them in turn.
func (p *Proxy) connect(pol egresspolicy.Policy, host string, port int) (net.Conn, string) {
	addrs, ok := p.cfg.Hosts[host]
	if !ok {
		ctx, cancel := context.WithTimeout(context.Background(), resolveTimeout)
		var err error
		addrs, err = p.cfg.Resolver.LookupNetIP(ctx, "ip", host)
		cancel()
		if err != nil || len(addrs) == 0 {
			return nil, ReasonResolveFailed
		}
	}
	var allowed []netip.Addr
	for _, a := range addrs {
		if pol.AllowsAddress(a) {
			allowed = append(allowed, a.Unmap())
		}
	}
	if len(allowed) == 0 {
		return nil, ReasonPrivateAddress
	}
	for _, a := range allowed {
		c, err := p.dial.Dial("tcp", netip.AddrPortFrom(a, uint16(port)).String())
		if err == nil {
			return c, ""
		}
	}
	return nil, ReasonConnectFailed
}

// tunnel answers a CONNECT, checks the ClientHello's SNI against the host
// and joins the two ends.
func (p *Proxy) tunnel(g Grant, m *meter, br *bufio.Reader, up net.Conn, d Decision) {
	if _, err := io.WriteString(m, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	_ = m.SetReadDeadline(time.Now().Add(headerTimeout))
	sni, hello, err := ReadClientHello(br)
	if err != nil && m.cutReason() != "" {
		p.finish(g, m, d) // a bound cut it while it was silent
		return
	}
	if err != nil {
		d.Decision, d.Reason = Denied, ReasonNotTLS
		d.BytesUp, d.BytesDown = m.counts()
		p.record(g, d)
		return
	}
	if name, ok := egresspolicy.NormalizeHost(sni); !ok || name != d.Host {
		d.Decision, d.Reason = Denied, ReasonSNIMismatch
		d.BytesUp, d.BytesDown = m.counts()
		p.record(g, d)
		return
	}
	_ = m.SetDeadline(time.Time{})
	if _, err := up.Write(hello); err != nil {
		p.finish(g, m, d)
		return
	}
	join(m, br, up)
	p.finish(g, m, d)
}

// forward sends one plain-HTTP request upstream in origin form, without
// hop-by-hop headers (those Connection names too) and asking the upstream
// to close, then copies the response back as it comes: the connection
// serves this one request, so the response needs no rewriting and streams
// at copy speed.
func (p *Proxy) forward(g Grant, m *meter, req *http.Request, up net.Conn, d Decision) {
	defer p.finish(g, m, d)
	dropHopByHop(req.Header)
	req.Close = true
	_ = m.SetDeadline(time.Time{})
	if err := req.Write(up); err != nil {
		return
	}
	m.toSandbox(up)
}

// join copies both ways until both ends are done, passing half-closes on.
func join(client *meter, fromClient *bufio.Reader, up net.Conn) {
	done := make(chan struct{})
	go func() {
		client.fromSandbox(up, fromClient)
		closeWrite(up)
		close(done)
	}()
	client.toSandbox(up)
	closeWrite(client.Conn)
	<-done
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}
