package egresspolicy

import (
	"fmt"
	"net/netip"
	"syscall"
)

// The address policy shared by the sandbox's egress proxy and the
// credential service's git route: an address a name may lead to unless a
// policy names it. It refuses private, loopback, link-local, metadata,
// unspecified, multicast and reserved addresses, and every IPv6 form that
// reaches or embeds one (docs/sandbox.md, "Addresses egress refuses").

// restrictedV4 are IPv4 ranges refused besides the private, loopback,
// link-local (169.254.169.254, the cloud metadata address, is one) and
// multicast ranges netip knows: "this network", carrier-grade NAT, IETF
// protocol assignments, the documentation and benchmarking ranges, the
// old 6to4 relay anycast and the reserved 240/4 with broadcast.
var restrictedV4 = prefixes(
	"0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24",
	"198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4",
)

// IPv6 is refused outside global unicast (2000::/3), which leaves out,
// among others: ::/96, IPv4-compatible (::127.0.0.1), deprecated;
// ::ffff:0:0:0/96, IPv4-translated (SIIT); 64:ff9b:1::/48, local-use
// NAT64, whose embedding the operator picks; 100::/64, discard-only;
// 5f00::/16, SRv6 segment identifiers; fec0::/10, site-local, deprecated
// but still routed by some stacks; and the unique-local, link-local and
// multicast ranges. Only the well-known NAT64 prefix is judged outside it,
// by the IPv4 address it carries. IPv4-mapped addresses (::ffff:a.b.c.d)
// are judged as the IPv4 address.
var globalUnicast = netip.MustParsePrefix("2000::/3")

// restrictedV6 are the refused ranges within global unicast: IETF
// protocol assignments (2001::/23: Teredo, 2001::/32, which tunnels to an
// obfuscated IPv4 address; benchmarking; ORCHID) and documentation.
var restrictedV6 = prefixes("2001::/23", "2001:db8::/32", "3fff::/20")

// Prefixes that carry an IPv4 address a router or translator forwards to:
// refused when that address is.
var (
	nat64     = netip.MustParsePrefix("64:ff9b::/96") // RFC 6052: the last 32 bits
	sixToFour = netip.MustParsePrefix("2002::/16")    // RFC 3056: bits 16 to 47
)

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// Restricted says whether ip is an address egress refuses unless a
// policy names it.
func Restricted(ip netip.Addr) bool {
	ip = ip.WithZone("").Unmap() // a zoned address matches no prefix
	if !ip.IsValid() || ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() ||
		ip.IsInterfaceLocalMulticast() || ip.IsMulticast() || ip.IsUnspecified() {
		return true
	}
	if v4, ok := embeddedV4(ip); ok {
		return Restricted(v4)
	}
	nets := restrictedV4
	if ip.Is6() {
		if !globalUnicast.Contains(ip) {
			return true
		}
		nets = restrictedV6
	}
	for _, n := range nets {
		if n.Contains(ip) {
			return true
		}
	}
	return false
}

// embeddedV4 is the IPv4 address a NAT64 or 6to4 address leads to.
func embeddedV4(ip netip.Addr) (netip.Addr, bool) {
	b := ip.As16()
	switch {
	case nat64.Contains(ip):
		return netip.AddrFrom4([4]byte(b[12:16])), true
	case sixToFour.Contains(ip):
		return netip.AddrFrom4([4]byte(b[2:6])), true
	}
	return netip.Addr{}, false
}

// AddressError is a dial refused by the address policy.
type AddressError struct{ Addr netip.Addr }

func (e *AddressError) Error() string {
	return fmt.Sprintf("address %s is private, loopback, link-local or reserved and not allowed", e.Addr)
}

// DialControl is a net.Dialer Control that refuses, after resolution and
// before connecting, every address allow does not accept: a name that
// resolves (or re-resolves, DNS rebinding) to a refused address is never
// connected to. allow nil means no address Restricted refuses.
func DialControl(allow func(netip.Addr) bool) func(network, address string, _ syscall.RawConn) error {
	if allow == nil {
		allow = func(a netip.Addr) bool { return !Restricted(a) }
	}
	return func(_, address string, _ syscall.RawConn) error {
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return fmt.Errorf("egress address %q: %w", address, err)
		}
		if a := ap.Addr(); !allow(a) {
			return &AddressError{Addr: a}
		}
		return nil
	}
}
