package grpcclient

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// TargetForms names the peer address forms ParseTarget accepts, for error
// messages and flag help.
const TargetForms = "host:port, host:port,host:port (a list) or dns:///name:port"

// Target is a peer address as users write it: one host:port, a
// comma-separated list of them (client-side round robin over the list), a
// dns:/// name (client-side round robin over what it resolves to, a
// headless Service), or a unix: socket path.
type Target struct {
	// Addrs is the host:port list of a plain address or a list; nil for a
	// dns: or unix: target.
	Addrs []string
	// Scheme is "dns", "unix" or "unix-abstract" for those targets, "" for
	// host:port and lists.
	Scheme string
	// Raw is the target as written, trimmed.
	Raw string
}

// RoundRobin reports whether calls spread over several backends: a list or
// a dns: name.
func (t Target) RoundRobin() bool { return len(t.Addrs) > 1 || t.Scheme == "dns" }

// ParseTarget validates a peer address setting. It is the one check every
// service's configuration and the wrapper apply to a peer address, and what
// Dial uses, so whatever passes validation dials.
func ParseTarget(s string) (Target, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return Target{}, errors.New("empty address")
	}
	for _, r := range s {
		if r < ' ' || r == 0x7f {
			return Target{}, errors.New("address contains a control character")
		}
	}
	t := Target{Raw: s}
	if scheme, rest, ok := strings.Cut(s, ":"); ok && isScheme(scheme) {
		t.Scheme = scheme
		if strings.Contains(rest, " ") {
			return Target{}, fmt.Errorf("%s: target contains a space", scheme)
		}
		switch scheme {
		case "unix", "unix-abstract":
			// Passed to gRPC unchanged (unix:path, unix:///abs/path).
			if strings.Trim(rest, "/") == "" {
				return Target{}, fmt.Errorf("%s: target without a socket path", scheme)
			}
			if strings.ContainsAny(rest, "?#%") {
				return Target{}, fmt.Errorf("%s: socket path with '?', '#' or '%%'", scheme)
			}
			return t, nil
		case "dns":
			// dns:///name:port or dns://resolver:53/name:port.
			if !strings.HasPrefix(rest, "//") {
				return Target{}, errors.New("want dns:///name:port")
			}
			authority, endpoint, ok := strings.Cut(rest[2:], "/")
			if !ok {
				return Target{}, errors.New("want dns:///name:port")
			}
			if authority != "" {
				if err := checkHostPort(authority); err != nil {
					return Target{}, fmt.Errorf("dns resolver %q: %w", authority, err)
				}
			}
			if err := checkHostPort(endpoint); err != nil {
				return Target{}, fmt.Errorf("dns target %q: %w", endpoint, err)
			}
			return t, nil
		}
	}
	if strings.Contains(s, "://") {
		return Target{}, fmt.Errorf("unsupported scheme in %q (want %s)", s, TargetForms)
	}
	seen := map[string]bool{}
	for a := range strings.SplitSeq(s, ",") {
		a = strings.TrimSpace(a)
		if a == "" {
			return Target{}, errors.New("empty entry in the address list")
		}
		if err := checkHostPort(a); err != nil {
			return Target{}, fmt.Errorf("%q: %w (want %s)", a, err, TargetForms)
		}
		if seen[a] {
			return Target{}, fmt.Errorf("%q listed twice", a)
		}
		seen[a] = true
		t.Addrs = append(t.Addrs, a)
	}
	return t, nil
}

func isScheme(s string) bool { return s == "dns" || s == "unix" || s == "unix-abstract" }

// checkHostPort accepts host:port with a host and a numeric port 1..65535.
func checkHostPort(a string) error {
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return err
	}
	if host == "" {
		return errors.New("missing host")
	}
	if net.ParseIP(host) == nil && !isHostname(host) {
		return fmt.Errorf("bad host %q", host)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return errors.New("port must be a number 1..65535")
	}
	return nil
}

// isHostname accepts DNS names: letters, digits, '-', '_' and dots.
func isHostname(h string) bool {
	for _, r := range h {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
		default:
			return false
		}
	}
	return true
}
