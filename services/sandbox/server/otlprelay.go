package server

import (
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"strings"

	"agentplane.dev/services/sandbox/internal/network/socketrelay"
)

// otlpTarget is where the sandbox service carries a wrapper's OTLP export
// (network and address to dial), read from the OTLP endpoint variables the
// wrapper inherits (wrapperTraceEnv; the traces-specific one wins, as in the
// exporter). ok is false when none is set: the wrapper exports nothing.
//
// Behind the boundary the wrapper's network is loopback only, so it sends
// its spans to a Unix socket handed in (--otlp-dir) and the sandbox service
// dials the collector; the bytes are relayed untouched, so TLS still ends at
// the collector under the endpoint's own name.
func otlpTarget(lookup func(string) (string, bool)) (network, addr string, ok bool, err error) {
	off := func(k, v string) bool { s, _ := lookup(k); return strings.EqualFold(strings.TrimSpace(s), v) }
	if off("OTEL_SDK_DISABLED", "true") || off("OTEL_TRACES_EXPORTER", "none") {
		return "", "", false, nil
	}
	raw := ""
	for _, k := range []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"} {
		if v, set := lookup(k); set && strings.TrimSpace(v) != "" {
			raw = strings.TrimSpace(v)
			break
		}
	}
	if raw == "" {
		return "", "", false, nil
	}
	bad := fmt.Errorf("OTLP endpoint %q: want http(s)://host:port, unix:///path or host:port", raw)
	u, perr := url.Parse(raw)
	switch {
	case perr == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "":
		if u.Port() == "" {
			// What gRPC dials for a target without a port.
			return "tcp", net.JoinHostPort(u.Hostname(), "443"), true, nil
		}
		return "tcp", u.Host, true, nil
	case perr == nil && u.Scheme == "unix" && u.Path != "":
		return "unix", u.Path, true, nil
	}
	if host, port, err := net.SplitHostPort(raw); err == nil && host != "" && port != "" && !strings.Contains(raw, "/") {
		return "tcp", raw, true, nil
	}
	return "", "", false, bad
}

// serveOTLPRelay binds the OTLP socket of this replica under socketDir and
// carries it to the collector; nil when no endpoint is set.
func serveOTLPRelay(socketDir, name string, lookup func(string) (string, bool), bounds socketrelay.Bounds) (*socketRelay, error) {
	network, addr, ok, err := otlpTarget(lookup)
	if err != nil || !ok {
		return nil, err
	}
	var d net.Dialer
	r, err := serveRelay(filepath.Join(socketDir, "otlp", name), bounds, func() (net.Conn, error) { return d.Dial(network, addr) })
	if err != nil {
		return nil, fmt.Errorf("OTLP socket: %w", err)
	}
	return r, nil
}
