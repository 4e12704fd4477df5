package grpcclient

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func TestParseTarget(t *testing.T) {
	for _, tc := range []struct {
		in     string
		addrs  []string
		scheme string
	}{
		{in: "127.0.0.1:7402", addrs: []string{"127.0.0.1:7402"}},
		{in: " sandbox.ns.svc:7402 ", addrs: []string{"sandbox.ns.svc:7402"}},
		{in: "a:1,b:2", addrs: []string{"a:1", "b:2"}},
		{in: "a:1, b:2 ,[::1]:3", addrs: []string{"a:1", "b:2", "[::1]:3"}},
		{in: "dns:///sandbox-headless.ns.svc:7402", scheme: "dns"},
		{in: "dns://10.0.0.10:53/sandbox:7402", scheme: "dns"},
		{in: "unix:///run/agentplane/control.sock", scheme: "unix"},
		{in: "unix:relative.sock", scheme: "unix"},
		{in: "unix-abstract:agentplane", scheme: "unix-abstract"},
	} {
		got, err := ParseTarget(tc.in)
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.addrs, got.Addrs, tc.in)
		require.Equal(t, tc.scheme, got.Scheme, tc.in)
	}
	for _, bad := range []string{
		"", " ", "host", ":7402", "host:", "host:0", "host:70000", "host:http", "a:1,", "a:1,,b:2", "a:1,a:1",
		"dns:sandbox:7402", "dns:///", "dns:///sandbox", "dns:///:7402", "dns://bad/sandbox:7402", "dns:///a:1,b:2",
		"http://host:1", "passthrough:///x:1", "unix:", "unix:///", "a b:1",
	} {
		_, err := ParseTarget(bad)
		require.Error(t, err, "%q", bad)
	}
}

// FuzzParseTarget: whatever ParseTarget accepts, Dial accepts too, and a
// list never yields an empty or spaced entry.
func FuzzParseTarget(f *testing.F) {
	for _, s := range []string{"127.0.0.1:7402", "a:1,b:2", "dns:///x.svc:7402", "unix:///s.sock", "dns://r:53/x:1", ",", "[::1]:1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tg, err := ParseTarget(s)
		if err != nil {
			return
		}
		for _, a := range tg.Addrs {
			require.NoError(t, checkHostPort(a))
		}
		if tg.Scheme == "" {
			require.NotEmpty(t, tg.Addrs)
		}
		conn, err := Dial(s, "")
		require.NoError(t, err)
		require.NoError(t, conn.Close())
	})
}

// counting is a health server that counts the calls it answered.
type counting struct {
	addr string
	mu   sync.Mutex
	n    int
}

func startCounting(t *testing.T) *counting {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	c := &counting{addr: lis.Addr().String()}
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		c.mu.Lock()
		c.n++
		c.mu.Unlock()
		return h(ctx, req)
	}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return c
}

func (c *counting) calls() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// A list spreads calls over every listed backend.
func TestDialListRoundRobin(t *testing.T) {
	a, b := startCounting(t), startCounting(t)
	conn, err := Dial(a.addr+","+b.addr, "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	hc := healthpb.NewHealthClient(conn)
	require.Eventually(t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
		return a.calls() > 0 && b.calls() > 0
	}, 30*time.Second, time.Millisecond, "calls reach both backends")
}

// A dns:/// name resolves and dials (round robin over what it resolves to).
func TestDialDNSTarget(t *testing.T) {
	a := startCounting(t)
	_, port, err := net.SplitHostPort(a.addr)
	require.NoError(t, err)
	conn, err := Dial("dns:///127.0.0.1:"+port, "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	require.NoError(t, err)
	require.Equal(t, 1, a.calls())
}

func TestDialRefusesBadAddress(t *testing.T) {
	_, err := Dial("a:1,,b:2", "")
	require.ErrorContains(t, err, "empty entry")
}
