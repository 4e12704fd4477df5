package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"

	"agentplane.dev/services/sandbox/internal/network/socketrelay"
	"agentplane.dev/services/sandbox/internal/node/boundary"
	"agentplane.dev/services/sandbox/internal/node/cgroup"
)

// sandboxProxyAddr is where a runtime behind the boundary finds the
// credential proxy: its sandbox's own loopback (every sandbox has its own
// network namespace, so one fixed address serves all).
const sandboxProxyAddr = "127.0.0.1:7405"

// maxSocketPath is the room for a Unix socket path (sun_path, with its NUL).
const maxSocketPath = 107

// boundarySetup is what the sandbox service runs for its boundary: the
// isolation config for the provider, the control socket its gRPC server
// also serves, the relay to the proxy, and the wrapper flags that tell a
// wrapper where to find them inside.
type boundarySetup struct {
	iso          *boundary.Config // nil: SANDBOX_ISOLATION=none
	controlLn    net.Listener
	controlAddr  string       // the control socket as a wrapper dials it, inside
	proxy        *socketRelay // to the credential proxy
	otlp         *socketRelay // to the OTLP collector (otlprelay.go)
	wrapperFlags []string
	cgroups      *cgroup.Manager    // nil: no cgroup limits (reported at start-up)
	bounds       socketrelay.Bounds // of every socket handed into sandboxes
}

func (b *boundarySetup) close() {
	b.proxy.close()
	b.otlp.close()
	if b.controlLn != nil {
		_ = b.controlLn.Close()
	}
}

// setUpBoundary probes the host (fail fast: isolation=namespaces that the
// kernel refuses is a configuration error, never a silent downgrade),
// binds the sockets under <root>/.sockets, and reports the cgroup limits
// as unavailable where they are.
func setUpBoundary(ctx context.Context, cfg Config, wrapperBin string, log *slog.Logger) (*boundarySetup, error) {
	if cfg.Isolation == boundary.ModeNone {
		log.Warn("SANDBOX_ISOLATION=none: sandboxes have NO boundary; runtimes share this service's user, PID and network namespace and can read its secrets through /proc")
		return &boundarySetup{}, nil
	}
	iso, err := cfg.boundaryConfig()
	if err != nil {
		return nil, err
	}
	bw, socketDir := iso.Bwrap, iso.SocketDir
	lim, _ := boundary.ParseLimits(cfg.Rlimits) // validated
	if err := iso.Probe(ctx, cfg.SandboxRoot, wrapperBin); err != nil {
		return nil, fmt.Errorf("SANDBOX_ISOLATION=namespaces: %w (set SANDBOX_ISOLATION=none to run without a boundary)", err)
	}
	b := &boundarySetup{iso: iso, bounds: cfg.socketBounds()}
	if why := fdBudget(b.bounds.PerPeer); why != "" {
		log.Warn("sandbox socket bounds too large for this service's open-file limit", "reason", why)
	}
	name := socketName(cfg.ReplicaID)
	for _, d := range []string{"control", "proxy"} {
		if err := os.MkdirAll(filepath.Join(socketDir, d), 0o755); err != nil {
			return nil, fmt.Errorf("sandbox sockets: %w", err)
		}
	}
	ctlPath := filepath.Join(socketDir, "control", name)
	if len(ctlPath) > maxSocketPath {
		return nil, fmt.Errorf("SANDBOX_ROOT %q is too long for its control socket %q (max %d bytes)", cfg.SandboxRoot, ctlPath, maxSocketPath)
	}
	if b.controlLn, err = socketrelay.Listen(ctlPath); err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	b.controlLn = socketrelay.Bound(b.controlLn, b.bounds)
	inner := boundary.InnerSocketDir
	b.controlAddr = "unix://" + inner + "/control/" + name
	b.wrapperFlags = []string{"--control-dir", inner + "/control", "--contained", "--nest-bwrap", bw, "--rlimits", lim.String()}
	if cfg.ProxyURL != "" {
		target, err := proxyTarget(cfg.ProxyURL)
		if err != nil {
			b.close()
			return nil, err
		}
		var d net.Dialer
		if b.proxy, err = serveRelay(filepath.Join(socketDir, "proxy", name), b.bounds, func() (net.Conn, error) { return d.Dial("tcp", target) }); err != nil {
			b.close()
			return nil, fmt.Errorf("proxy socket: %w", err)
		}
		b.wrapperFlags = append(b.wrapperFlags, "--proxy-listen", sandboxProxyAddr, "--proxy-dir", inner+"/proxy")
	}
	if b.otlp, err = serveOTLPRelay(socketDir, name, os.LookupEnv, b.bounds); err != nil {
		b.close()
		return nil, err
	}
	if b.otlp != nil {
		b.wrapperFlags = append(b.wrapperFlags, "--otlp-dir", inner+"/otlp")
	}
	uid := "the service's"
	if cred := iso.Credential(); cred != nil {
		uid = fmt.Sprint(cred.Uid)
	}
	log.Info("sandbox isolation: namespaces", "bwrap", bw, "sandbox_uid", uid, "rlimits", lim.String(),
		"agents", iso.Agents, "readonly_paths", iso.ReadOnly, "control_socket", ctlPath)
	if why := lim.CheckFileTable(boundary.HostFileMax()); why != "" {
		log.Warn("sandbox rlimits too large for this host", "reason", why)
	}
	b.cgroups = detectCgroups(cfg, log)
	return b, nil
}

func (c *Config) boundaryConfig() (*boundary.Config, error) {
	bw, err := boundary.FindBwrap(c.Bwrap)
	if err != nil {
		return nil, fmt.Errorf("SANDBOX_ISOLATION=namespaces needs bubblewrap (or set SANDBOX_ISOLATION=none explicitly): %w", err)
	}
	agentsDir := ""
	if c.AgentsDir != "" {
		agentsDir = filepath.Clean(c.AgentsDir)
	}
	return &boundary.Config{Bwrap: bw, Agents: agentsDir, ReadOnly: c.readOnlyPaths(), SocketDir: filepath.Join(c.SandboxRoot, ".sockets"),
		UID: c.SandboxUID, GID: c.SandboxUID, Nested: true}, nil
}

// ProbeIsolation runs the start-up probe of SANDBOX_ISOLATION=namespaces for
// c without starting anything: nil when the host allows the boundary with
// this configuration, else why not. It reports the host uid sandboxes would
// run as ("" for the service's own).
func ProbeIsolation(ctx context.Context, c Config) (uid string, err error) {
	iso, err := c.boundaryConfig()
	if err != nil {
		return "", err
	}
	cmd, err := c.wrapperCommand()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(c.SandboxRoot, 0o755); err != nil {
		return "", fmt.Errorf("sandbox root: %w", err)
	}
	if cred := iso.Credential(); cred != nil {
		uid = fmt.Sprint(cred.Uid)
	}
	return uid, iso.Probe(ctx, c.SandboxRoot, cmd[0])
}

// CgroupLimits says whether per-sandbox cgroup limits are available here,
// and why not.
func CgroupLimits() (bool, string) {
	m, why := cgroup.Detect(cgroupRoot)
	return m != nil, why
}

// cgroupRoot is where the host's cgroup hierarchies are mounted.
const cgroupRoot = "/sys/fs/cgroup"

// sampledLimits is what holds without cgroups (DESIGN.md 3.3, host shape
// "neither").
const sampledLimits = "memory per sandbox is sampled (stopped with memory_limit over SANDBOX_MEMORY_LIMIT), CPU is weighted (SANDBOX_NICE, SCHED_BATCH), not capped; processes by rlimits only"

// detectCgroups finds where sandboxes' cgroups go, and reports at start-up
// the limits this host cannot enforce.
func detectCgroups(cfg Config, log *slog.Logger) *cgroup.Manager {
	if cfg.Cgroups == "off" {
		log.Warn("SANDBOX_CGROUPS=off: "+sampledLimits, "memory_bytes", uint64(cfg.MemoryLimit), "nice", cfg.Nice)
		return nil
	}
	m, why := cgroup.Detect(cgroupRoot)
	if m == nil {
		log.Warn("sandbox cgroup limits unavailable: "+sampledLimits, "reason", why, "memory_bytes", uint64(cfg.MemoryLimit), "nice", cfg.Nice)
		return nil
	}
	l := cfg.cgroupLimits()
	log.Info("sandbox cgroup limits", "cgroup_version", int(m.Version()), "memory_bytes", l.MemoryBytes, "cpu_millis", l.CPUMillis, "pids", l.Pids)
	return m
}

// socketName is a replica's socket file name: short (sun_path is small)
// and distinct per replica sharing the root.
func socketName(replica string) string {
	sum := sha256.Sum256([]byte(replica))
	return hex.EncodeToString(sum[:6]) + ".sock"
}

// proxyTarget is the host:port the relay dials for a proxy base URL.
func proxyTarget(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "", errors.New("SANDBOX_PROXY_URL: want an http(s) URL")
	}
	if u.Port() != "" {
		return u.Host, nil
	}
	if u.Scheme == "https" {
		return net.JoinHostPort(u.Hostname(), "443"), nil
	}
	return net.JoinHostPort(u.Hostname(), "80"), nil
}
