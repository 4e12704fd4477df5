package egresspolicy

import (
	"net"
	"net/netip"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRestrictedForms names every form of an internal address the policy
// refuses, each next to a public address of the same form it lets through.
func TestRestrictedForms(t *testing.T) {
	refused := map[string][]string{
		"ipv4 loopback":         {"127.0.0.1", "127.255.255.254"},
		"ipv4 private":          {"10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1"},
		"ipv4 link-local":       {"169.254.0.1", "169.254.169.254"},
		"ipv4 cgnat":            {"100.64.0.1", "100.127.255.255"},
		"ipv4 this network":     {"0.0.0.0", "0.1.2.3"},
		"ipv4 ietf":             {"192.0.0.170"},
		"ipv4 documentation":    {"192.0.2.1", "198.51.100.1", "203.0.113.1"},
		"ipv4 benchmarking":     {"198.18.0.1", "198.19.255.255"},
		"ipv4 6to4 relay":       {"192.88.99.1"},
		"ipv4 multicast":        {"224.0.0.1", "239.255.255.250"},
		"ipv4 reserved":         {"240.0.0.1", "255.255.255.255"},
		"ipv6 loopback":         {"::1"},
		"ipv6 unspecified":      {"::"},
		"ipv4-mapped":           {"::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::ffff:7f00:1"},
		"ipv4-compatible":       {"::127.0.0.1", "::10.0.0.1", "::169.254.169.254", "::8.8.8.8"},
		"ipv4-translated":       {"::ffff:0:127.0.0.1", "::ffff:0:8.8.8.8"},
		"6to4":                  {"2002:7f00:1::1", "2002:a00:1::", "2002:a9fe:a9fe::1", "2002:c0a8:101:1::1", "2002:6440:1::1"},
		"teredo":                {"2001:0:4136:e378:8000:63bf:80ff:fffe", "2001::1", "2001:0:5ef5:79fd::f5ff:f7fe"},
		"nat64 well-known":      {"64:ff9b::127.0.0.1", "64:ff9b::a00:1", "64:ff9b::169.254.169.254", "64:ff9b::192.168.0.1"},
		"nat64 local-use":       {"64:ff9b:1::1", "64:ff9b:1:ffff::8.8.8.8"},
		"ipv6 site-local":       {"fec0::1", "feff:ffff::1"},
		"ipv6 unique-local":     {"fc00::1", "fd00:ec2::254", "fdff::1"},
		"ipv6 link-local":       {"fe80::1", "febf::1", "fe80::1%eth0"},
		"ipv6 multicast":        {"ff02::1", "ff05::2", "ff0e::1"},
		"ipv6 discard":          {"100::1"},
		"ipv6 ietf":             {"2001:2::1", "2001:10::1", "2001:20::1"},
		"ipv6 documentation":    {"2001:db8::1", "3fff::1"},
		"ipv6 srv6":             {"5f00::1"},
		"ipv6 unallocated":      {"4000::1", "8000::1", "e000::1"},
		"zoned site-local":      {"fec0::1%1"},
		"zoned mapped loopback": {"::ffff:127.0.0.1%eth0"},
	}
	for form, addrs := range refused {
		for _, a := range addrs {
			require.True(t, Restricted(netip.MustParseAddr(a)), "%s %s", form, a)
		}
	}
	for _, a := range []string{
		"8.8.8.8", "93.184.216.34", "1.1.1.1", "::ffff:8.8.8.8", "2606:2800:220:1::1", "2a00:1450:4001::200e",
		"2002:808:808::1",  // 6to4 of 8.8.8.8
		"64:ff9b::8.8.8.8", // DNS64 of a public address
		"2001:200::1",      // outside the IETF /23
		"172.32.0.1", "100.128.0.1", "169.255.0.1", "11.0.0.1",
	} {
		require.False(t, Restricted(netip.MustParseAddr(a)), a)
	}
	require.True(t, Restricted(netip.Addr{}), "the zero address")
}

// TestAllowsAddressForms: naming an address in private_networks allows it
// (and its IPv4-mapped form) and no other form that embeds it.
func TestAllowsAddressForms(t *testing.T) {
	p := Policy{PrivateNetworks: []string{"127.0.0.1"}}
	require.True(t, p.AllowsAddress(netip.MustParseAddr("::ffff:127.0.0.1")))
	for _, a := range []string{"::127.0.0.1", "2002:7f00:1::1", "64:ff9b::127.0.0.1", "::ffff:0:127.0.0.1"} {
		require.False(t, p.AllowsAddress(netip.MustParseAddr(a)), a)
	}
	p = Policy{PrivateNetworks: []string{"fe80::/10"}}
	require.True(t, p.AllowsAddress(netip.MustParseAddr("fe80::1%eth0")), "a zone does not hide a named network")
}

// TestDialControlRefusesAfterResolution dials a name through a Dialer with
// DialControl: the check sees the resolved address, so a name of a
// loopback listener is refused with an AddressError and never connected.
func TestDialControlRefusesAfterResolution(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- struct{}{}
			_ = c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	d := net.Dialer{Control: DialControl(nil)}
	_, err = d.Dial("tcp", net.JoinHostPort("localhost", itoa(port)))
	var ae *AddressError
	require.ErrorAs(t, err, &ae)
	require.True(t, ae.Addr.IsLoopback())
	allowLoopback := func(a netip.Addr) bool { return a.IsLoopback() || !Restricted(a) }
	d = net.Dialer{Control: DialControl(allowLoopback)}
	c, err := d.Dial("tcp", net.JoinHostPort("127.0.0.1", itoa(port)))
	require.NoError(t, err, "an explicit allow lets the same address through")
	_ = c.Close()
	<-accepted
	require.Empty(t, accepted, "only the allowed dial connected")
	require.Error(t, DialControl(nil)("tcp", "not an address", syscall.RawConn(nil)))
}

func itoa(n int) string {
	return netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(n)).String()[len("0.0.0.0:"):]
}

// The embedding forms of an IPv4 address, built here independently of the
// policy's own decoding.
func embeddings(v4 [4]byte, teredoServer [4]byte) map[string]netip.Addr {
	var mapped, compat, translated, sixToFour, teredoClient, teredoSrv, nat64WK, nat64Local [16]byte
	copy(mapped[10:], []byte{0xff, 0xff})
	copy(mapped[12:], v4[:])
	copy(compat[12:], v4[:])
	copy(translated[8:], []byte{0xff, 0xff, 0, 0})
	copy(translated[12:], v4[:])
	sixToFour[0], sixToFour[1] = 0x20, 0x02
	copy(sixToFour[2:], v4[:])
	for _, b := range []*[16]byte{&teredoClient, &teredoSrv} {
		b[0], b[1] = 0x20, 0x01
	}
	copy(teredoClient[4:], teredoServer[:])
	for i := range 4 {
		teredoClient[12+i] = ^v4[i] // the client address is stored inverted
	}
	copy(teredoSrv[4:], v4[:])
	copy(nat64WK[:], []byte{0, 0x64, 0xff, 0x9b})
	copy(nat64WK[12:], v4[:])
	copy(nat64Local[:], []byte{0, 0x64, 0xff, 0x9b, 0, 1})
	copy(nat64Local[6:], v4[:2]) // RFC 6052 /48: bits 48-63, then u, then the rest
	copy(nat64Local[9:], v4[2:])
	return map[string]netip.Addr{
		"mapped": netip.AddrFrom16(mapped), "compat": netip.AddrFrom16(compat), "translated": netip.AddrFrom16(translated),
		"6to4": netip.AddrFrom16(sixToFour), "teredo client": netip.AddrFrom16(teredoClient),
		"teredo server": netip.AddrFrom16(teredoSrv), "nat64": netip.AddrFrom16(nat64WK), "nat64 local": netip.AddrFrom16(nat64Local),
	}
}

// FuzzRestrictedEmbeddings checks the policy against a reference: every
// IPv6 form that carries a refused IPv4 address is refused; the forms a
// translator or relay carries to a public IPv4 address (mapped, 6to4,
// well-known NAT64) are judged as that address; the deprecated forms
// (compatible, translated, Teredo, local-use NAT64) are always refused.
// Every address also gets the same answer through its text, zoned or not.
func FuzzRestrictedEmbeddings(f *testing.F) {
	for _, s := range []string{"127.0.0.1", "10.0.0.1", "169.254.169.254", "8.8.8.8", "100.64.0.1", "0.0.0.0", "192.168.1.1"} {
		a := netip.MustParseAddr(s).As4()
		f.Add(a[:], []byte{65, 54, 227, 120}, []byte{})
	}
	f.Add([]byte{8, 8, 8, 8}, []byte{0, 0, 0, 0}, []byte{0xfe, 0xc0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1})
	f.Fuzz(func(t *testing.T, v4b, server, any16 []byte) {
		if len(v4b) < 4 || len(server) < 4 {
			return
		}
		v4 := netip.AddrFrom4([4]byte(v4b[:4]))
		refused := Restricted(v4)
		for form, a := range embeddings([4]byte(v4b[:4]), [4]byte(server[:4])) {
			got := Restricted(a)
			switch form {
			case "mapped", "6to4", "nat64":
				if got != refused {
					t.Fatalf("%s %s of %s: refused %v, the IPv4 address %v", form, a, v4, got, refused)
				}
			default:
				if !got {
					t.Fatalf("%s %s of %s is let through", form, a, v4)
				}
			}
		}
		if len(any16) >= 16 {
			a := netip.AddrFrom16([16]byte(any16[:16]))
			got := Restricted(a)
			if again := Restricted(netip.MustParseAddr(a.String())); again != got {
				t.Fatalf("%s: %v, its text %v", a, got, again)
			}
			if zoned := Restricted(a.WithZone("eth0")); zoned != got {
				t.Fatalf("%s: %v, zoned %v", a, got, zoned)
			}
			if a.Is4In6() && got != Restricted(a.Unmap()) {
				t.Fatalf("%s: %v, unmapped %v", a, got, !got)
			}
			wk := netip.MustParsePrefix("64:ff9b::/96")
			if !got && !a.Is4In6() && a.As16()[0]&0xe0 != 0x20 && !wk.Contains(a) {
				t.Fatalf("%s outside 2000::/3 is let through", a)
			}
		}
	})
}
