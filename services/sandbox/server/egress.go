package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/control/store"
	"agentplane.dev/services/sandbox/internal/edge/notify"
	"agentplane.dev/services/sandbox/internal/network/egress"
	"agentplane.dev/services/sandbox/internal/network/egresshandoff"
	"agentplane.dev/services/sandbox/internal/network/socketrelay"
	"agentplane.dev/services/sandbox/internal/node/boundary"
)

// sandboxEgressAddr is where a runtime behind the boundary finds the egress
// proxy (its HTTP_PROXY and HTTPS_PROXY): the sandbox's own loopback, like
// the credential proxy.
const sandboxEgressAddr = "127.0.0.1:7406"

// EgressConfig is the egress proxy's configuration (docs/sandbox.md
// "Egress").
type EgressConfig struct {
	Allow    string   // SANDBOX_EGRESS_ALLOW: the deployment's default policy (egresspolicy.ParseList)
	Hosts    string   // SANDBOX_EGRESS_HOSTS: static name map, name=addr|addr,... (answered before DNS)
	MaxConns int      // SANDBOX_EGRESS_MAX_CONNS: open connections per sandbox
	MaxBytes ByteSize // SANDBOX_EGRESS_MAX_BYTES: bytes of all a sandbox's connections, both ways, per BytesWindow
	// BytesWindow (SANDBOX_EGRESS_BYTES_WINDOW) is MaxBytes's window: one
	// starts with the sandbox's first connection after the previous ended.
	BytesWindow time.Duration
	Idle        time.Duration // SANDBOX_EGRESS_IDLE: a connection with nothing moving this long is closed
}

// DefaultEgressConfig: nothing allowed by default, generous bounds.
func DefaultEgressConfig() EgressConfig {
	return EgressConfig{MaxConns: 64, MaxBytes: 4 << 30, BytesWindow: time.Hour, Idle: 5 * time.Minute}
}

// Bind registers the settings on l.
func (c *EgressConfig) Bind(l *config.Loader) {
	l.String(&c.Allow, "SANDBOX_EGRESS_ALLOW", c.Allow, "default egress policy of every session: host patterns with optional ports (registry.npmjs.org,*.pypi.org:443,example.com:80|8080) and private address ranges names may resolve to (10.0.0.0/8)")
	l.String(&c.Hosts, "SANDBOX_EGRESS_HOSTS", c.Hosts, "static name map of the egress proxy, answered before DNS: name=addr|addr,...")
	l.Int(&c.MaxConns, "SANDBOX_EGRESS_MAX_CONNS", c.MaxConns, "open egress connections per sandbox")
	def := c.MaxBytes
	l.Var(&c.MaxBytes, "SANDBOX_EGRESS_MAX_BYTES", &def, "bytes all of a sandbox's egress connections may carry together, both ways, per SANDBOX_EGRESS_BYTES_WINDOW (bytes, or with KiB/MiB/GiB/TiB)")
	l.Duration(&c.BytesWindow, "SANDBOX_EGRESS_BYTES_WINDOW", c.BytesWindow, "window of SANDBOX_EGRESS_MAX_BYTES: one starts with a sandbox's first egress connection after the previous one ended")
	l.Duration(&c.Idle, "SANDBOX_EGRESS_IDLE", c.Idle, "close an egress connection with nothing moving this long")
}

// Validate names each bad setting.
func (c *EgressConfig) Validate() error {
	var errs []error
	if _, err := egresspolicy.ParseList(c.Allow, egresspolicy.MaxRulesCeiling); err != nil {
		errs = append(errs, config.ErrorFor("SANDBOX_EGRESS_ALLOW", err))
	}
	if _, err := parseHosts(c.Hosts); err != nil {
		errs = append(errs, config.ErrorFor("SANDBOX_EGRESS_HOSTS", err))
	}
	if c.MaxConns <= 0 {
		errs = append(errs, config.ErrorFor("SANDBOX_EGRESS_MAX_CONNS", errors.New("must be positive")))
	}
	if c.MaxBytes == 0 {
		errs = append(errs, config.ErrorFor("SANDBOX_EGRESS_MAX_BYTES", errors.New("must be positive")))
	}
	if c.BytesWindow <= 0 {
		errs = append(errs, config.ErrorFor("SANDBOX_EGRESS_BYTES_WINDOW", errors.New("must be positive")))
	}
	if c.Idle <= 0 {
		errs = append(errs, config.ErrorFor("SANDBOX_EGRESS_IDLE", errors.New("must be positive")))
	}
	return errors.Join(errs...)
}

func parseHosts(s string) (map[string][]netip.Addr, error) {
	out := map[string][]netip.Addr{}
	for item := range strings.SplitSeq(s, ",") {
		if item = strings.TrimSpace(item); item == "" {
			continue
		}
		name, addrs, ok := strings.Cut(item, "=")
		host, valid := egresspolicy.NormalizeHost(name)
		if !ok || !valid {
			return nil, fmt.Errorf("entry %q: want name=addr|addr", item)
		}
		for a := range strings.SplitSeq(addrs, "|") {
			ip, err := netip.ParseAddr(a)
			if err != nil {
				return nil, fmt.Errorf("entry %q: %q is not an address", item, a)
			}
			out[host] = append(out[host], ip)
		}
	}
	return out, nil
}

// egressSetup is the egress proxy's socket under <root>/.sockets/egress
// and the wrapper flags that offer it inside; none without the boundary
// (a runtime with the host's network needs no proxy to leave).
type egressSetup struct {
	ln           net.Listener
	done         chan struct{}
	wrapperFlags []string
}

func listenEgress(b *boundarySetup, replica string) (*egressSetup, error) {
	e := &egressSetup{}
	if b.iso == nil {
		return e, nil
	}
	dir := filepath.Join(b.iso.SocketDir, "egress")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("egress socket: %w", err)
	}
	ln, err := socketrelay.Listen(filepath.Join(dir, socketName(replica)))
	if err != nil {
		return nil, fmt.Errorf("egress socket: %w", err)
	}
	e.ln = socketrelay.Bound(ln, b.bounds)
	e.wrapperFlags = []string{"--egress-listen", sandboxEgressAddr, "--egress-dir", boundary.InnerSocketDir + "/egress"}
	return e, nil
}

// serve starts the proxy on the socket: policies and audit from the
// driver's routes, events through the notifier, decisions counted on reg.
func (e *egressSetup) serve(cfg EgressConfig, drv *driver.Driver, n *notify.Notifier, reg *prometheus.Registry, log *slog.Logger) error {
	if e.ln == nil {
		return nil
	}
	decisions := egress.NewDecisions()
	if err := reg.Register(decisions); err != nil {
		return err
	}
	def, _ := egresspolicy.ParseList(cfg.Allow, egresspolicy.MaxRulesCeiling) // validated
	hosts, _ := parseHosts(cfg.Hosts)                                         // validated
	p := egress.New(egress.Config{
		Authorize: func(_ context.Context, id egresshandoff.Identity) (egress.Grant, error) {
			eg, err := drv.EgressWrapper(id.SandboxID, id.Instance, id.Credential)
			if errors.Is(err, driver.ErrEgressNotOwner) {
				return egress.Grant{}, egress.ErrNotOwner // the wrapper offers it to the next replica
			}
			if err != nil {
				return egress.Grant{}, err
			}
			return egressGrant(drv, n, log, id.SandboxID, eg), nil
		},
		Ledger:  windowLedger{drv},
		Default: def, Hosts: hosts, Decisions: decisions, Log: log,
		Limits: egress.Limits{MaxConns: cfg.MaxConns, MaxBytes: int64(cfg.MaxBytes), BytesWindow: cfg.BytesWindow, Idle: cfg.Idle},
	})
	e.done = make(chan struct{})
	go func() { p.Serve(e.ln); close(e.done) }()
	return nil
}

func (e *egressSetup) close() {
	if e.ln != nil {
		_ = e.ln.Close()
		if e.done != nil {
			<-e.done
		}
	}
}

// windowLedger keeps the sandboxes' egress byte windows in the sandbox
// store, written by the owner under its fencing token.
type windowLedger struct{ drv *driver.Driver }

func (l windowLedger) Load(ctx context.Context, sandboxID string) (egress.Window, error) {
	w, err := l.drv.EgressWindow(ctx, sandboxID)
	return egress.Window{Start: w.Start, Used: w.Used}, err
}

func (l windowLedger) Save(ctx context.Context, sandboxID string, w egress.Window, ends time.Time) error {
	return l.drv.SaveEgressWindow(ctx, sandboxID, store.EgressWindow{Start: w.Start, Used: w.Used}, ends)
}

// egressGrant reads the runtime key's routes on every request (the union
// of their policies, so a change applies to the next connection) and
// audits each decision on every session of the runtime; its bounds count
// under the owner token the wrapper was authenticated with.
func egressGrant(drv *driver.Driver, n *notify.Notifier, log *slog.Logger, sandboxID string, eg driver.EgressGrant) egress.Grant {
	key := eg.RuntimeKey
	return egress.Grant{
		Key:   sandboxID,
		Owner: eg.OwnerToken,
		Policy: func() (egresspolicy.Policy, error) {
			routes, err := drv.EgressRoutes(sandboxID, key)
			if err != nil {
				return egresspolicy.Policy{}, err
			}
			ps := make([]egresspolicy.Policy, 0, len(routes))
			for _, r := range routes {
				ps = append(ps, r.Policy)
			}
			return egresspolicy.Union(ps...), nil
		},
		Audit: func(d egress.Decision) {
			if d.Decision != egress.Allowed {
				log.Info("egress", "sandbox", sandboxID, "runtime_key", key, "host", d.Host, "port", d.Port,
					"decision", d.Decision, "reason", d.Reason)
			}
			routes, _ := drv.EgressRoutes(sandboxID, key)
			for _, r := range routes {
				expected := d.Decision == egress.Denied && r.ExpectsDenial != nil && r.ExpectsDenial(d.Host)
				n.Events(r.Ref, []driver.RuntimeEvent{egressEvent(r.RuntimeSessionID, key, expected, d)})
			}
		},
	}
}

// egressEvent is the EGRESS runtime event of a decision on one route:
// the session service makes it an audit record of the route's session
// (runtime_key names the runtime; expected, a denial the route's agent
// profile expects, is counted there rather than recorded one by one).
func egressEvent(runtimeSessionID, runtimeKey string, expected bool, d egress.Decision) driver.RuntimeEvent {
	id := make([]byte, 12)
	_, _ = rand.Read(id)
	return driver.RuntimeEvent{
		ID: "egress-" + hex.EncodeToString(id), RuntimeSessionID: runtimeSessionID, Kind: driver.EventEgress,
		Text: fmt.Sprintf("egress %s %s:%d (%s)", d.Decision, d.Host, d.Port, d.Reason),
		Data: map[string]any{
			"kind": d.Kind, "host": d.Host, "port": d.Port, "decision": d.Decision, "reason": d.Reason,
			"bytes_up": d.BytesUp, "bytes_down": d.BytesDown, "runtime_key": runtimeKey, "expected": expected,
		},
		Time: time.Now(),
	}
}
