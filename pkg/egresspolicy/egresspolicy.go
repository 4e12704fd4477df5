// Package egresspolicy is the egress allowlist of a session's runtime: the
// syntax every API checks (session at CreateSession and
// UpdateEgressPolicy, sandbox again on its own contract and for its
// deployment default) and the decisions the sandbox's egress proxy takes.
// Default deny: a destination is allowed only when a rule names its host
// and port. A name that resolves to a private, loopback, link-local or
// metadata address is refused unless PrivateNetworks covers the address.
package egresspolicy

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// Limits of one policy.
const (
	DefaultMaxRules    = 256  // configurable per deployment (the session service's)
	MaxRulesCeiling    = 4096 // no deployment allows more (the sandbox's own check)
	MaxPortsPerRule    = 16
	MaxPrivateNetworks = 16
	MaxHostLen         = 253
)

// DefaultPorts are a rule's ports when it names none.
var DefaultPorts = []uint32{80, 443}

// Rule allows one exact name or wildcard suffix ("*.example.org": every
// name below example.org, not example.org itself) on some ports.
type Rule struct {
	Host  string   `json:"host"`
	Ports []uint32 `json:"ports,omitempty"`
}

// Policy is an allowlist. The zero Policy allows nothing.
type Policy struct {
	Allow           []Rule   `json:"allow,omitempty"`
	PrivateNetworks []string `json:"private_networks,omitempty"`
}

// Problem is one thing wrong with a policy, at a field relative to it
// ("allow[2].host").
type Problem struct {
	Field, Description string
}

// Empty says whether p allows nothing of its own.
func (p Policy) Empty() bool { return len(p.Allow) == 0 && len(p.PrivateNetworks) == 0 }

// Validate returns every problem of p; maxRules ≤ 0 means DefaultMaxRules.
func (p Policy) Validate(maxRules int) []Problem {
	if maxRules <= 0 {
		maxRules = DefaultMaxRules
	}
	var out []Problem
	if len(p.Allow) > maxRules {
		// Nothing else is worth reading in an oversized policy.
		return []Problem{{"allow", fmt.Sprintf("at most %d rules", maxRules)}}
	}
	for i, r := range p.Allow {
		f := fmt.Sprintf("allow[%d]", i)
		if d := CheckPattern(r.Host); d != "" {
			out = append(out, Problem{f + ".host", d})
		}
		if len(r.Ports) > MaxPortsPerRule {
			out = append(out, Problem{f + ".ports", fmt.Sprintf("at most %d ports", MaxPortsPerRule)})
			continue
		}
		for j, port := range r.Ports {
			if port == 0 || port > 65535 {
				out = append(out, Problem{fmt.Sprintf("%s.ports[%d]", f, j), "1 to 65535"})
			}
		}
	}
	if len(p.PrivateNetworks) > MaxPrivateNetworks {
		return append(out, Problem{"private_networks", fmt.Sprintf("at most %d networks", MaxPrivateNetworks)})
	}
	for i, n := range p.PrivateNetworks {
		if _, err := parseNetwork(n); err != nil {
			out = append(out, Problem{fmt.Sprintf("private_networks[%d]", i), "want a CIDR (10.0.0.0/8) or one address"})
		}
	}
	return out
}

// CheckPattern returns what is wrong with a host pattern, or "": a
// lower-case DNS name (labels of a-z, 0-9 and '-', 1 to 63 bytes, not
// starting or ending with '-'), or "*." and a name of at least two labels.
// An IP address is no pattern: addresses are named in PrivateNetworks.
func CheckPattern(h string) string {
	name, wild := strings.CutPrefix(h, "*.")
	switch {
	case h == "":
		return "required"
	case h == "*" || h == "*.":
		return "empty wildcard: name a suffix (*.example.org)"
	case strings.Contains(name, "*"):
		return "a wildcard is only allowed as the first label (*.example.org)"
	case len(h) > MaxHostLen:
		return fmt.Sprintf("at most %d bytes", MaxHostLen)
	}
	if d := checkName(name); d != "" {
		return d
	}
	if wild && !strings.Contains(name, ".") {
		return "a wildcard needs a suffix of at least two labels (*.example.org, not *.org)"
	}
	return ""
}

func checkName(name string) string {
	if name == "" {
		return "empty name"
	}
	if _, err := netip.ParseAddr(name); err == nil {
		return "an IP address is not a host pattern (name private addresses in private_networks)"
	}
	labels := strings.Split(name, ".")
	for _, l := range labels {
		if l == "" || len(l) > 63 {
			return "each label is 1 to 63 bytes"
		}
		if l[0] == '-' || l[len(l)-1] == '-' {
			return "a label neither starts nor ends with '-'"
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return "only lower-case letters, digits, '-' and '.' are allowed"
			}
		}
	}
	if last := labels[len(labels)-1]; strings.Trim(last, "0123456789") == "" {
		return "the last label is not all digits"
	}
	return ""
}

// Union is every rule and network of ps (the policy of a runtime that
// several sessions share).
func Union(ps ...Policy) Policy {
	var out Policy
	for _, p := range ps {
		out.Allow = append(out.Allow, p.Allow...)
		for _, n := range p.PrivateNetworks {
			if !slices.Contains(out.PrivateNetworks, n) {
				out.PrivateNetworks = append(out.PrivateNetworks, n)
			}
		}
	}
	return out
}

// NormalizeHost lower-cases a requested host and drops one trailing dot;
// ok is false for anything that is not a DNS name (an IP literal too).
func NormalizeHost(h string) (string, bool) {
	h = strings.TrimSuffix(strings.ToLower(h), ".")
	if len(h) > MaxHostLen || checkName(h) != "" {
		return "", false
	}
	return h, true
}

// Allows says whether p allows host (normalized) on port.
func (p Policy) Allows(host string, port int) bool {
	for _, r := range p.Allow {
		if !matches(r.Host, host) {
			continue
		}
		ports := r.Ports
		if len(ports) == 0 {
			ports = DefaultPorts
		}
		if slices.Contains(ports, uint32(port)) {
			return true
		}
	}
	return false
}

func matches(pattern, host string) bool {
	if suffix, ok := strings.CutPrefix(pattern, "*."); ok {
		return strings.HasSuffix(host, "."+suffix)
	}
	return pattern == host
}

// AllowsAddress says whether a name of p may lead to ip: a public address
// always; one Restricted refuses (private, loopback, link-local, metadata,
// unspecified, multicast, reserved, or an IPv6 form of one) only when
// PrivateNetworks covers it.
func (p Policy) AllowsAddress(ip netip.Addr) bool {
	ip = ip.WithZone("").Unmap()
	if !Restricted(ip) {
		return true
	}
	for _, n := range p.PrivateNetworks {
		if pre, err := parseNetwork(n); err == nil && pre.Contains(ip) {
			return true
		}
	}
	return false
}

func parseNetwork(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		return p.Masked(), err
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// ParseList reads a policy written as one comma-separated line (the
// deployment default, SANDBOX_EGRESS_ALLOW): host patterns, each with
// optional ports after ':' separated by '|' ("registry.npmjs.org",
// "*.pypi.org:443", "example.com:80|443"), and address ranges
// ("10.0.0.0/8", "127.0.0.1") that go to PrivateNetworks. The result is
// validated.
func ParseList(s string, maxRules int) (Policy, error) {
	var p Policy
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if _, err := parseNetwork(item); err == nil {
			p.PrivateNetworks = append(p.PrivateNetworks, item)
			continue
		}
		host, ports, hasPorts := strings.Cut(item, ":")
		r := Rule{Host: host}
		if hasPorts {
			for ps := range strings.SplitSeq(ports, "|") {
				n, err := strconv.ParseUint(ps, 10, 32)
				if err != nil {
					return Policy{}, fmt.Errorf("egress policy %q: port %q is not a number", item, ps)
				}
				r.Ports = append(r.Ports, uint32(n))
			}
		}
		p.Allow = append(p.Allow, r)
	}
	if probs := p.Validate(maxRules); len(probs) > 0 {
		return Policy{}, fmt.Errorf("egress policy: %s: %s", probs[0].Field, probs[0].Description)
	}
	return p, nil
}
