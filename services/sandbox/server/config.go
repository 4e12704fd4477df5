// Package server is the sandbox service's public entry: its configuration and
// Run, used by cmd/sandbox and by cmd/agentplane (all services in one
// process).
package server

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/control/allocation"
	"agentplane.dev/services/sandbox/internal/node/boundary"
	"agentplane.dev/services/sandbox/internal/node/capacity"
	"agentplane.dev/services/sandbox/internal/node/cgroup"
)

// Config is the sandbox service's configuration.
type Config struct {
	config.Common

	SandboxRoot string // SANDBOX_ROOT: process-provider root (one directory per sandbox)
	// WrapperCommand is the wrapper program and its leading args; default
	// [os.Executable(), "wrapper"]. Set from WRAPPER_BIN and WRAPPER_ARGS.
	WrapperCommand []string
	WrapperBin     string // WRAPPER_BIN: binary whose `wrapper` subcommand is the wrapper; empty: this binary
	WrapperArgs    string // WRAPPER_ARGS: extra wrapper flags, space separated (e.g. --capabilities=)

	SessionAddr    string // SESSION_ADDR: SessionNotifyService; empty logs notifications only
	CredentialAddr string // CREDENTIAL_ADDR: empty gives routes no handle (dev/test)
	ProxyURL       string // SANDBOX_PROXY_URL: credential proxy base URL handed to runtimes
	ControlAddrs   string // SANDBOX_CONTROL_ADDRS: addresses wrappers dial, comma separated; empty: GRPC_ADDR

	// NotifyDrain (SANDBOX_NOTIFY_DRAIN) bounds sending the notifications
	// still queued at shutdown, after the driver stopped; 0 drops them.
	NotifyDrain time.Duration

	ReplicaID string // SANDBOX_REPLICA: this replica's name in owner leases
	// AdvertiseAddr (SANDBOX_ADVERTISE_ADDR) is the host:port other services
	// reach this replica at, named in its owner leases; empty: GRPC_ADDR
	// when that names a host (or the Listener's address).
	AdvertiseAddr string
	OwnerTTL      time.Duration // SANDBOX_OWNER_TTL: owner lease TTL (renewed every TTL/3)
	// EmptyGrace (SANDBOX_EMPTY_GRACE) is how long a sandbox with no
	// session left stays owned before the replica lets it go.
	EmptyGrace time.Duration

	Timers allocation.Timers // SANDBOX_CREATE_TIMEOUT, _HELLO_TIMEOUT, _HEARTBEAT, _DEAD_AFTER, _RECONNECT_WINDOW, _IDLE_STOP

	// CapacityThreshold (SANDBOX_CAPACITY_THRESHOLD) is the free space a
	// cold workspace needs (DESIGN.md 3.4); StaleAge (SANDBOX_STALE_AGE) is
	// the mtime age past which stale cleanup may remove a directory.
	CapacityThreshold ByteSize
	StaleAge          time.Duration
	// The boundary (DESIGN.md 3.3, docs/sandbox.md "The boundary").
	Isolation     string // SANDBOX_ISOLATION: namespaces (default) or none (explicit, warned)
	Bwrap         string // SANDBOX_BWRAP: bubblewrap binary; empty: bwrap on PATH
	ReadOnlyPaths string // SANDBOX_READONLY_PATHS: host paths bound read-only into sandboxes (installed agents), colon separated
	SandboxUID    int    // SANDBOX_UID: host uid (and gid) sandboxes run as when the service is root; -1 keeps the service's
	// Cgroup limits per sandbox (internal/node/cgroup): SANDBOX_CGROUPS is auto
	// (where the host lets this service create groups) or off.
	Cgroups     string
	MemoryLimit ByteSize // SANDBOX_MEMORY_LIMIT: memory per sandbox
	CPULimit    int      // SANDBOX_CPU_LIMIT: CPU per sandbox in thousandths of a core
	PidsLimit   int      // SANDBOX_PIDS_LIMIT: processes and threads per sandbox
	// Nice (SANDBOX_NICE) is the nice value, with SCHED_BATCH, of every
	// sandbox's processes where no cgroup limits CPU: weighting, not a cap.
	Nice int
	// SocketConns (SANDBOX_SOCKET_CONNS) bounds each sandbox's open
	// connections to every socket handed into it (control, credential proxy,
	// egress, OTLP); SocketIdle (SANDBOX_SOCKET_IDLE) closes one that read
	// nothing this long.
	// DiskQuota (SANDBOX_DISK_QUOTA) is each sandbox's disk (workspaces
	// and homes); 0: none.
	DiskQuota   ByteSize
	SocketConns int
	SocketIdle  time.Duration
	Rlimits     string // SANDBOX_RLIMITS: per-sandbox rlimits, e.g. nofile=1024,nproc=512,as=68719476736,fsize=4294967296,cpu=14400
	Deployment  string // SANDBOX_DEPLOYMENT: deployment id in the wrappers' markers; empty: derived from SANDBOX_ROOT
	// Egress is the egress proxy's (server/egress.go).
	Egress EgressConfig
	// The warm pool (DESIGN.md 3.8, internal/node/warmpool): Pool
	// (SANDBOX_POOL, profile=N,...) pooled sandboxes per agent profile on
	// this replica, for routes at PoolDirectory (SANDBOX_POOL_DIRECTORY).
	Pool          string
	PoolDirectory string

	// Agent profiles (internal/agent/agents, docs/runtime-protocol.md).
	AgentsDir    string // AGENTS_DIR: where `make agents` installed the pinned agents (holds node_modules); empty: no opencode/kilo
	AgentACP     string // AGENT_ACP_COMMAND: command line of the generic acp profile, space separated; empty: no acp profile
	AgentModel   string // AGENT_MODEL: default model of the ACP profiles
	AgentDefault string // AGENT_DEFAULT: profile of a session that names none
	// AgentExpectedDenials adds hosts whose egress denials profiles expect
	// (AGENT_EXPECTED_DENIALS: profile=host|host,...).
	AgentExpectedDenials string
}

// DefaultConfig returns the dev defaults (ports from docs/development.md).
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		Common:      config.DefaultCommon("127.0.0.1:7402", "127.0.0.1:9402"),
		SandboxRoot: filepath.Join(os.TempDir(), "agentplane", "sandboxes"),
		SessionAddr: "127.0.0.1:7401",
		ProxyURL:    "http://127.0.0.1:7405",
		ReplicaID:   fmt.Sprintf("%s-%d", host, os.Getpid()),
		OwnerTTL:    15 * time.Second,
		EmptyGrace:  30 * time.Second,
		NotifyDrain: 5 * time.Second,
		Timers:      allocation.DefaultTimers(),

		CapacityThreshold: capacity.DefaultThreshold,
		StaleAge:          capacity.DefaultStaleAge,
		AgentModel:        "default",
		AgentDefault:      agents.Scripted,
		Isolation:         boundary.ModeNamespaces,
		SandboxUID:        65534, // nobody
		Rlimits:           boundary.DefaultLimits.String(),
		Cgroups:           "auto",
		SocketConns:       32,
		DiskQuota:         4 << 30,
		SocketIdle:        5 * time.Minute,
		MemoryLimit:       ByteSize(cgroup.DefaultLimits.MemoryBytes),
		CPULimit:          int(cgroup.DefaultLimits.CPUMillis),
		PidsLimit:         int(cgroup.DefaultLimits.Pids),
		Nice:              10,
		Egress:            DefaultEgressConfig(),
		PoolDirectory:     "/workspace",
	}
}

// Agents builds the agent profile registry of the configuration.
func (c *Config) Agents() *agents.Registry {
	expected, _ := agents.ParseExpectedDenials(c.AgentExpectedDenials) // Validate refuses a bad one
	cfg := agents.Config{Dir: c.AgentsDir, ACPCommand: strings.Fields(c.AgentACP), Model: c.AgentModel, Default: c.AgentDefault,
		ExpectedDenials: expected}
	if c.Isolation == boundary.ModeNamespaces {
		cfg.Inside = boundary.InnerAgents // boundaryConfig binds AgentsDir there
	}
	return agents.New(cfg)
}

// Bind registers every setting on l with c's values as defaults.
func (c *Config) Bind(l *config.Loader) {
	c.Common.Bind(l)
	l.String(&c.SandboxRoot, "SANDBOX_ROOT", c.SandboxRoot, "process-provider root directory (absolute)")
	l.String(&c.WrapperBin, "WRAPPER_BIN", c.WrapperBin, "binary whose `wrapper` subcommand runs the wrapper; empty: this binary")
	l.String(&c.WrapperArgs, "WRAPPER_ARGS", c.WrapperArgs, "extra wrapper flags, space separated")
	l.String(&c.SessionAddr, "SESSION_ADDR", c.SessionAddr, "session service (SessionNotifyService); empty only logs notifications; "+config.PeerAddrHelp)
	l.Duration(&c.NotifyDrain, "SANDBOX_NOTIFY_DRAIN", c.NotifyDrain, "bound on sending queued notifications at shutdown; 0 drops them")
	l.String(&c.CredentialAddr, "CREDENTIAL_ADDR", c.CredentialAddr, "credential service; empty gives routes no handle (dev only); "+config.PeerAddrHelp)
	l.String(&c.ProxyURL, "SANDBOX_PROXY_URL", c.ProxyURL, "credential proxy base URL handed to runtimes")
	l.String(&c.ControlAddrs, "SANDBOX_CONTROL_ADDRS", c.ControlAddrs, "sandbox-service addresses wrappers dial in turn, comma separated (host:port, dns:///name:port or unix:path each); empty: GRPC_ADDR")
	l.String(&c.AgentsDir, "AGENTS_DIR", c.AgentsDir, "directory of the pinned agents (`make agents` installs into agents/); empty: no opencode or kilo profile")
	l.String(&c.AgentACP, "AGENT_ACP_COMMAND", c.AgentACP, "command line of the generic acp agent profile; empty: no acp profile")
	l.String(&c.AgentModel, "AGENT_MODEL", c.AgentModel, "default model of the ACP agent profiles")
	l.String(&c.AgentDefault, "AGENT_DEFAULT", c.AgentDefault, "agent profile of a session that names none")
	l.String(&c.AgentExpectedDenials, "AGENT_EXPECTED_DENIALS", c.AgentExpectedDenials,
		"hosts whose egress denials an agent profile expects, counted on one audit record per turn and host: profile=host|*.domain,profile=host (added to the built-in ones)")
	l.String(&c.ReplicaID, "SANDBOX_REPLICA", c.ReplicaID, "this replica's name in owner leases")
	l.String(&c.AdvertiseAddr, "SANDBOX_ADVERTISE_ADDR", c.AdvertiseAddr, "host:port callers reach this replica at, named in its owner leases; empty: GRPC_ADDR when it names a host")
	l.Duration(&c.OwnerTTL, "SANDBOX_OWNER_TTL", c.OwnerTTL, "owner lease TTL of a sandbox")
	l.Duration(&c.EmptyGrace, "SANDBOX_EMPTY_GRACE", c.EmptyGrace, "how long a sandbox with no session left stays owned before the replica lets it go")
	l.Duration(&c.Timers.Create, "SANDBOX_CREATE_TIMEOUT", c.Timers.Create, "bound on creating a sandbox")
	l.Duration(&c.Timers.FirstHello, "SANDBOX_HELLO_TIMEOUT", c.Timers.FirstHello, "launch → first Hello bound")
	l.Duration(&c.Timers.Heartbeat, "SANDBOX_HEARTBEAT", c.Timers.Heartbeat, "wrapper heartbeat interval")
	l.Duration(&c.Timers.DeadAfter, "SANDBOX_DEAD_AFTER", c.Timers.DeadAfter, "a wrapper without heartbeat this long is disconnected")
	l.Duration(&c.Timers.ReconnectWindow, "SANDBOX_RECONNECT_WINDOW", c.Timers.ReconnectWindow, "how long a disconnected wrapper may reconnect")
	l.Duration(&c.Timers.IdleStop, "SANDBOX_IDLE_STOP", c.Timers.IdleStop, "stop a wrapper after this long without activity")
	def := c.CapacityThreshold
	l.Var(&c.CapacityThreshold, "SANDBOX_CAPACITY_THRESHOLD", &def, "free space a cold workspace needs (bytes, or with KiB/MiB/GiB/TiB)")
	l.Duration(&c.StaleAge, "SANDBOX_STALE_AGE", c.StaleAge, "stale cleanup removes only directories older than this (by mtime)")
	l.String(&c.Isolation, "SANDBOX_ISOLATION", c.Isolation, "namespaces (bubblewrap boundary per runtime key) or none (no boundary: explicit only)")
	l.String(&c.Bwrap, "SANDBOX_BWRAP", c.Bwrap, "bubblewrap binary; empty: bwrap on PATH")
	l.String(&c.ReadOnlyPaths, "SANDBOX_READONLY_PATHS", c.ReadOnlyPaths, "host paths bound read-only into every sandbox (installed agent runtimes), colon separated")
	l.Int(&c.SandboxUID, "SANDBOX_UID", c.SandboxUID, "host uid and gid sandboxes run as when the service runs as root; -1 keeps the service's")
	l.String(&c.Cgroups, "SANDBOX_CGROUPS", c.Cgroups, "cgroup limits per sandbox: auto (where the host allows) or off")
	mem := c.MemoryLimit
	l.Var(&c.MemoryLimit, "SANDBOX_MEMORY_LIMIT", &mem, "memory per sandbox (bytes, or with KiB/MiB/GiB); over it the sandbox stops with memory_limit")
	l.Int(&c.CPULimit, "SANDBOX_CPU_LIMIT", c.CPULimit, "CPU per sandbox in thousandths of a core (1000: one core)")
	l.Int(&c.PidsLimit, "SANDBOX_PIDS_LIMIT", c.PidsLimit, "processes and threads per sandbox")
	l.Int(&c.Nice, "SANDBOX_NICE", c.Nice, "without cgroup limits: nice value (0-19, with SCHED_BATCH) of every sandbox's processes; 0: none")
	quota := c.DiskQuota
	l.Var(&c.DiskQuota, "SANDBOX_DISK_QUOTA", &quota, "disk per sandbox, workspaces and homes (bytes, or with KiB/MiB/GiB); 0: none")
	l.Int(&c.SocketConns, "SANDBOX_SOCKET_CONNS", c.SocketConns, "open connections of one sandbox to each socket handed into it")
	l.Duration(&c.SocketIdle, "SANDBOX_SOCKET_IDLE", c.SocketIdle, "close a sandbox's connection to a handed-in socket that read nothing this long")
	l.String(&c.Rlimits, "SANDBOX_RLIMITS", c.Rlimits, "per-sandbox rlimits: nofile=N,nproc=N,as=BYTES,fsize=BYTES,cpu=SECONDS")
	l.String(&c.Deployment, "SANDBOX_DEPLOYMENT", c.Deployment, "deployment id in wrapper markers; empty: derived from the sandbox root")
	l.String(&c.Pool, "SANDBOX_POOL", c.Pool, "warm pool: pooled sandboxes per agent profile, profile=N,... (e.g. opencode=2); empty: none")
	l.String(&c.PoolDirectory, "SANDBOX_POOL_DIRECTORY", c.PoolDirectory, "the session directory pooled sandboxes serve (a route at another directory launches cold)")
	c.Egress.Bind(l)
}

// Validate checks every setting and names the variable and flag of each bad one.
func (c *Config) Validate() error {
	errs := []error{c.Common.Validate(), c.Egress.Validate()}
	bad := func(name string, err error) { errs = append(errs, config.ErrorFor(name, err)) }
	if !filepath.IsAbs(c.SandboxRoot) {
		bad("SANDBOX_ROOT", errors.New("must be an absolute path"))
	}
	errs = append(errs,
		config.CheckPeerAddr("SESSION_ADDR", c.SessionAddr, false),
		config.CheckPeerAddr("CREDENTIAL_ADDR", c.CredentialAddr, false))
	c.validateAddrs(bad)
	if c.AgentsDir != "" && !filepath.IsAbs(c.AgentsDir) {
		bad("AGENTS_DIR", errors.New("must be an absolute path"))
	}
	if _, err := c.Agents().Resolve("", ""); err != nil {
		bad("AGENT_DEFAULT", err)
	}
	if _, err := agents.ParseExpectedDenials(c.AgentExpectedDenials); err != nil {
		bad("AGENT_EXPECTED_DENIALS", err)
	}
	if sizes, err := ParsePool(c.Pool); err != nil {
		bad("SANDBOX_POOL", err)
	} else {
		// A configured profile that is not installed is the pool's to
		// report at start (AGENT_UNAVAILABLE); a name no profile has is a typo.
		names := c.Agents().Names()
		for profile := range sizes {
			if !slices.Contains(names, profile) {
				bad("SANDBOX_POOL", fmt.Errorf("no agent profile %q (configured: %s)", profile, strings.Join(names, ", ")))
			}
		}
	}
	if !filepath.IsAbs(c.PoolDirectory) || filepath.Clean(c.PoolDirectory) != c.PoolDirectory {
		bad("SANDBOX_POOL_DIRECTORY", errors.New("must be a clean absolute path"))
	}
	if c.ReplicaID == "" || strings.ContainsAny(c.ReplicaID, ":@ ") {
		bad("SANDBOX_REPLICA", errors.New("required, without ':', '@' or spaces"))
	}
	c.validateTimers(bad)
	if c.CapacityThreshold == 0 {
		bad("SANDBOX_CAPACITY_THRESHOLD", errors.New("must be positive"))
	}
	c.validateBoundary(bad)
	if c.Nice < 0 || c.Nice > 19 {
		bad("SANDBOX_NICE", errors.New("must be 0 to 19"))
	}
	if c.SocketConns <= 0 {
		bad("SANDBOX_SOCKET_CONNS", errors.New("must be positive"))
	}
	if strings.ContainsAny(c.Deployment, "= \x00") {
		bad("SANDBOX_DEPLOYMENT", errors.New("must not contain '=', spaces or NUL"))
	}
	return errors.Join(errs...)
}

// validateAddrs checks the addresses wrappers and sandboxes are given:
// the control addresses (tried in turn; each entry one target: host:port,
// dns:///name:port or a unix: socket), the proxy URL and the advertised
// address.
func (c *Config) validateAddrs(bad func(string, error)) {
	for _, a := range splitList(c.ControlAddrs) {
		if t, err := grpcclient.ParseTarget(a); err != nil {
			bad("SANDBOX_CONTROL_ADDRS", fmt.Errorf("entry %q: %w", a, err))
		} else if len(t.Addrs) > 1 {
			bad("SANDBOX_CONTROL_ADDRS", fmt.Errorf("entry %q: one target per entry", a))
		}
	}
	if c.ProxyURL != "" {
		if u, err := url.Parse(c.ProxyURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("SANDBOX_PROXY_URL", errors.New("want an http(s) URL"))
		}
	}
	if c.AdvertiseAddr != "" {
		if t, err := grpcclient.ParseTarget(c.AdvertiseAddr); err != nil || len(t.Addrs) != 1 {
			bad("SANDBOX_ADVERTISE_ADDR", errors.New("want one host:port"))
		}
	}
}

// validateTimers checks the durations: the lifecycle timers positive, a
// wrapper declared dead only after more than a heartbeat, and the bounds
// that depend on them.
func (c *Config) validateTimers(bad func(string, error)) {
	if c.EmptyGrace < 0 {
		bad("SANDBOX_EMPTY_GRACE", errors.New("must not be negative"))
	}
	if c.NotifyDrain < 0 {
		bad("SANDBOX_NOTIFY_DRAIN", errors.New("must not be negative"))
	}
	if c.OwnerTTL < 30*time.Millisecond {
		bad("SANDBOX_OWNER_TTL", errors.New("must be at least 30ms"))
	}
	for name, d := range map[string]time.Duration{
		"SANDBOX_CREATE_TIMEOUT": c.Timers.Create, "SANDBOX_HELLO_TIMEOUT": c.Timers.FirstHello,
		"SANDBOX_HEARTBEAT": c.Timers.Heartbeat, "SANDBOX_DEAD_AFTER": c.Timers.DeadAfter,
		"SANDBOX_RECONNECT_WINDOW": c.Timers.ReconnectWindow, "SANDBOX_IDLE_STOP": c.Timers.IdleStop,
	} {
		if d <= 0 {
			bad(name, errors.New("must be positive"))
		}
	}
	if c.StaleAge < time.Minute {
		bad("SANDBOX_STALE_AGE", errors.New("must be at least 1m: a younger directory may be a route being prepared"))
	}
	if c.SocketIdle < 2*c.Timers.DeadAfter {
		bad("SANDBOX_SOCKET_IDLE", errors.New("must be at least twice SANDBOX_DEAD_AFTER: a wrapper's stream reads heartbeats no more often"))
	}
	if c.Timers.DeadAfter <= c.Timers.Heartbeat {
		bad("SANDBOX_DEAD_AFTER", errors.New("must exceed SANDBOX_HEARTBEAT"))
	}
}

// validateBoundary checks the sandbox boundary's settings: isolation
// mode, read-only paths, uid, cgroup and rlimit bounds.
func (c *Config) validateBoundary(bad func(string, error)) {
	if c.Isolation != boundary.ModeNamespaces && c.Isolation != boundary.ModeNone {
		bad("SANDBOX_ISOLATION", fmt.Errorf("want %s or %s", boundary.ModeNamespaces, boundary.ModeNone))
	}
	for _, p := range c.readOnlyPaths() {
		if !filepath.IsAbs(p) {
			bad("SANDBOX_READONLY_PATHS", fmt.Errorf("%q is not an absolute path", p))
		}
	}
	if c.SandboxUID < -1 {
		bad("SANDBOX_UID", errors.New("want a uid, or -1"))
	}
	if c.CPULimit < 0 || c.PidsLimit < 0 {
		bad("SANDBOX_CPU_LIMIT", errors.New("SANDBOX_CPU_LIMIT and SANDBOX_PIDS_LIMIT must not be negative (0: unset)"))
	}
	if c.Cgroups != "auto" && c.Cgroups != "off" {
		bad("SANDBOX_CGROUPS", errors.New("want auto or off"))
	}
	if _, err := boundary.ParseLimits(c.Rlimits); err != nil {
		bad("SANDBOX_RLIMITS", err)
	}
}

// LoadConfig reads the configuration from args and the environment and validates it.
func LoadConfig(args []string, lookupEnv func(string) (string, bool)) (Config, error) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("sandbox", flag.ContinueOnError)
	l := config.NewLoader(fs, lookupEnv)
	c.Bind(l)
	if err := l.Parse(args); err != nil {
		return c, err
	}
	return c, c.Validate()
}

// advertiseAddr is the address this replica's owner leases name: the
// setting, else the listener's or GRPC_ADDR when it names a host; "" when
// it listens on every interface without saying which one callers use.
func (c *Config) advertiseAddr(grpcLn net.Listener) string {
	if c.AdvertiseAddr != "" {
		return c.AdvertiseAddr
	}
	addr := c.GRPCAddr
	if grpcLn != nil {
		addr = grpcLn.Addr().String()
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil || host == "" || net.ParseIP(host).IsUnspecified() {
		return ""
	}
	return addr
}

// localControlAddr is the address wrappers on this host dial when
// SANDBOX_CONTROL_ADDRS is empty: the listener's, with an unspecified host
// (":7402", "0.0.0.0:7402") made loopback, which a client cannot dial.
func (c *Config) localControlAddr(grpcLn net.Listener) string {
	addr := c.GRPCAddr
	if grpcLn != nil {
		addr = grpcLn.Addr().String()
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return net.JoinHostPort("127.0.0.1", port)
	}
	return addr
}

// wrapperCommand resolves the wrapper command.
func (c *Config) wrapperCommand() ([]string, error) {
	if len(c.WrapperCommand) > 0 {
		return c.WrapperCommand, nil
	}
	bin := c.WrapperBin
	if bin == "" {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		bin = self
	}
	return append([]string{bin, "wrapper"}, strings.Fields(c.WrapperArgs)...), nil
}

// readOnlyPaths are SANDBOX_READONLY_PATHS plus the directory of the
// generic acp profile's program: an agent profile the service offers must
// be runnable inside the boundary without the operator listing its
// directory twice. (The pinned agents' directory is bound at
// boundary.InnerAgents instead.)
func (c *Config) readOnlyPaths() []string {
	var out []string
	if f := strings.Fields(c.AgentACP); len(f) > 0 && filepath.IsAbs(f[0]) {
		out = append(out, filepath.Dir(filepath.Clean(f[0])))
	}
	for _, p := range strings.Split(c.ReadOnlyPaths, ":") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, filepath.Clean(p))
		}
	}
	return out
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// cgroupLimits are the cgroup limits of every sandbox.
func (c *Config) cgroupLimits() cgroup.Limits {
	return cgroup.Limits{MemoryBytes: uint64(c.MemoryLimit), CPUMillis: uint64(c.CPULimit), Pids: uint64(c.PidsLimit)}
}

// ParsePool parses SANDBOX_POOL: profile=N pairs, comma separated; N from
// 0 (off) to 64.
func ParsePool(s string) (map[string]int, error) {
	out := map[string]int{}
	for _, pair := range strings.Split(s, ",") {
		if pair = strings.TrimSpace(pair); pair == "" {
			continue
		}
		name, n, ok := strings.Cut(pair, "=")
		size, err := strconv.Atoi(strings.TrimSpace(n))
		name = strings.TrimSpace(name)
		switch {
		case !ok || name == "":
			return nil, fmt.Errorf("%q: want profile=N", pair)
		case err != nil || size < 0 || size > 64:
			return nil, fmt.Errorf("%q: N must be 0 to 64", pair)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("profile %q named twice", name)
		}
		out[name] = size
	}
	return out, nil
}
