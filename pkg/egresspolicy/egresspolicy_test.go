package egresspolicy

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCheckPattern(t *testing.T) {
	for _, ok := range []string{"packages.example.com", "*.example.org", "localhost", "a-b.c0.test", "xn--bcher-kva.example"} {
		require.Empty(t, CheckPattern(ok), ok)
	}
	for bad, want := range map[string]string{
		"": "required", "*": "empty wildcard", "*.": "empty wildcard", "*.org": "two labels",
		"a.*.example.org": "first label", "Example.com": "lower-case", "a..b": "label", "-a.example": "'-'",
		"10.0.0.1": "IP address", "::1": "IP address", "1.2.3": "all digits", "exa mple.com": "lower-case",
		strings.Repeat("a", 64) + ".com": "63", "a_b.example": "lower-case",
	} {
		require.Contains(t, CheckPattern(bad), want, bad)
	}
}

func TestValidate(t *testing.T) {
	p := Policy{Allow: []Rule{{Host: "ok.example"}, {Host: "*"}, {Host: "b.example", Ports: []uint32{0, 443, 70000}}},
		PrivateNetworks: []string{"10.0.0.0/8", "nope"}}
	require.Equal(t, []Problem{
		{"allow[1].host", "empty wildcard: name a suffix (*.example.org)"},
		{"allow[2].ports[0]", "1 to 65535"}, {"allow[2].ports[2]", "1 to 65535"},
		{"private_networks[1]", "want a CIDR (10.0.0.0/8) or one address"},
	}, p.Validate(0))
	big := Policy{Allow: make([]Rule, 3)}
	require.Equal(t, []Problem{{"allow", "at most 2 rules"}}, big.Validate(2))
	require.Empty(t, Policy{}.Validate(0))
}

func TestAllows(t *testing.T) {
	p := Policy{Allow: []Rule{{Host: "packages.example.com"}, {Host: "*.example.org", Ports: []uint32{8443}}}}
	require.True(t, p.Allows("packages.example.com", 443))
	require.True(t, p.Allows("packages.example.com", 80))
	require.False(t, p.Allows("packages.example.com", 22), "default ports are 80 and 443")
	require.False(t, p.Allows("evil-packages.example.com", 443))
	require.False(t, p.Allows("packages.example.com.evil.test", 443))
	require.True(t, p.Allows("a.b.example.org", 8443))
	require.False(t, p.Allows("example.org", 8443), "a wildcard is below its suffix, not the suffix")
	require.False(t, p.Allows("aexample.org", 8443))
	require.False(t, p.Allows("a.example.org", 443))
	require.False(t, Policy{}.Allows("packages.example.com", 443), "default deny")
	u := Union(p, Policy{Allow: []Rule{{Host: "other.test"}}, PrivateNetworks: []string{"127.0.0.1"}})
	require.True(t, u.Allows("other.test", 443))
	require.True(t, u.Allows("packages.example.com", 443))
}

func TestAllowsAddress(t *testing.T) {
	var none Policy
	for _, a := range []string{"127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
		"0.0.0.0", "::1", "fe80::1", "fd00:ec2::254", "::ffff:127.0.0.1", "224.0.0.1", "::"} {
		require.False(t, none.AllowsAddress(netip.MustParseAddr(a)), a)
	}
	for _, a := range []string{"93.184.216.34", "2606:2800:220:1::1"} {
		require.True(t, none.AllowsAddress(netip.MustParseAddr(a)), a)
	}
	p := Policy{PrivateNetworks: []string{"127.0.0.1", "10.0.0.0/8"}}
	require.True(t, p.AllowsAddress(netip.MustParseAddr("127.0.0.1")))
	require.True(t, p.AllowsAddress(netip.MustParseAddr("::ffff:127.0.0.1")))
	require.True(t, p.AllowsAddress(netip.MustParseAddr("10.9.9.9")))
	require.False(t, p.AllowsAddress(netip.MustParseAddr("127.0.0.2")))
	require.False(t, p.AllowsAddress(netip.MustParseAddr("169.254.169.254")))
}

func TestParseList(t *testing.T) {
	p, err := ParseList(" registry.npmjs.org, *.pypi.org:443 ,example.com:80|8080,127.0.0.1,10.0.0.0/8,", 0)
	require.NoError(t, err)
	require.Equal(t, Policy{Allow: []Rule{{Host: "registry.npmjs.org"}, {Host: "*.pypi.org", Ports: []uint32{443}},
		{Host: "example.com", Ports: []uint32{80, 8080}}}, PrivateNetworks: []string{"127.0.0.1", "10.0.0.0/8"}}, p)
	for _, bad := range []string{"*", "a.example:x", "a.example:0", "Bad.example"} {
		_, err := ParseList(bad, 0)
		require.Error(t, err, bad)
	}
	p, err = ParseList("", 0)
	require.NoError(t, err)
	require.True(t, p.Empty())
}

// FuzzParseList: the deployment default and every pattern the APIs take
// either fail validation or give a policy whose rules all validate and
// whose decisions never panic.
func FuzzParseList(f *testing.F) {
	for _, s := range []string{"registry.npmjs.org,*.pypi.org:443", "*", "*.", "a:1|2|3", "127.0.0.1,::1/128", "x..y", ":::", "*.*.a.b"} {
		f.Add(s, "a.pypi.org", 443)
	}
	f.Fuzz(func(t *testing.T, s, host string, port int) {
		p, err := ParseList(s, 8)
		if err != nil {
			return
		}
		require.Empty(t, p.Validate(8))
		for _, r := range p.Allow {
			require.Empty(t, CheckPattern(r.Host))
			require.NotContains(t, strings.TrimPrefix(r.Host, "*."), "*")
		}
		if h, ok := NormalizeHost(host); ok {
			require.Empty(t, checkName(h))
			_ = p.Allows(h, port)
		}
		if a, err := netip.ParseAddr(host); err == nil {
			_ = p.AllowsAddress(a)
		}
	})
}
