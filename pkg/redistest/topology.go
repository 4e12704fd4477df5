package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// EnvTopology chooses the Redis topology that Universal and UniversalURL
// give the store and fence suites: "single" (default), "cluster" (3
// masters + 3 replicas) or "sentinel" (1 master, 1 replica, 3 sentinels).
const EnvTopology = "AGENTPLANE_TEST_REDIS"

// Topology is the value of EnvTopology ("single" when unset).
func Topology() string {
	if v := os.Getenv(EnvTopology); v != "" {
		return v
	}
	return "single"
}

// Universal returns a client on the topology EnvTopology names, closed in
// tb.Cleanup. A single server is the test's own; a Cluster or Sentinel
// group is started once per test binary and flushed for each caller, so
// tests that use it must not run in parallel with each other.
func Universal(tb testing.TB) redis.UniversalClient {
	tb.Helper()
	c, err := clientFor(UniversalURL(tb))
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// UniversalURL returns the URL of a store on the topology EnvTopology
// names, in the forms the services' AGENTPLANE_REDIS_URL accepts
// (redis://, redis+cluster://, redis+sentinel://), flushed for this caller.
func UniversalURL(tb testing.TB) string {
	tb.Helper()
	switch t := Topology(); t {
	case "single":
		return Start(tb).URL()
	case "cluster":
		return shared(tb, &sharedCluster, func(dir string) (flusher, error) {
			c, err := NewCluster(dir)
			if err != nil {
				return nil, err
			}
			return c, nil
		}).URL()
	case "sentinel":
		return shared(tb, &sharedSentinel, func(dir string) (flusher, error) {
			g, err := NewSentinel(dir)
			if err != nil {
				return nil, err
			}
			return g, nil
		}).URL()
	default:
		tb.Fatalf("redistest: %s=%q: want single, cluster or sentinel", EnvTopology, t)
		return ""
	}
}

// clientFor is a client for the URL forms UniversalURL returns.
func clientFor(url string) (redis.UniversalClient, error) {
	scheme, rest, _ := strings.Cut(url, "://")
	switch scheme {
	case "redis+cluster":
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(rest, ","), ContextTimeoutEnabled: true}), nil
	case "redis+sentinel":
		hosts, master, _ := strings.Cut(rest, "/")
		return redis.NewFailoverClient(&redis.FailoverOptions{MasterName: master, SentinelAddrs: strings.Split(hosts, ","), ContextTimeoutEnabled: true}), nil
	}
	o, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	return redis.NewClient(o), nil
}

type flusher interface {
	URL() string
	FlushAll(ctx context.Context) error
	Close() error
}

// FlushAll empties every master behind rdb: a Cluster client's FLUSHALL
// reaches one node only.
func FlushAll(ctx context.Context, rdb redis.UniversalClient) error {
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.FlushAll(ctx).Err() })
	}
	return rdb.FlushAll(ctx).Err()
}

// Shared wraps a TestMain's m so that the Cluster or Sentinel group
// Universal started is stopped, and its files removed, once m's tests
// ended (before goleak looks for leftover goroutines):
//
//	goleak.VerifyTestMain(redistest.Shared(m))
func Shared(m interface{ Run() int }) interface{ Run() int } { return sharedM{m} }

type sharedM struct{ m interface{ Run() int } }

func (s sharedM) Run() int {
	code := s.m.Run()
	for _, g := range []*sharedGroup{&sharedCluster, &sharedSentinel} {
		if g.g != nil {
			_ = g.g.Close()
			_ = os.RemoveAll(g.dir)
		}
	}
	return code
}

type sharedGroup struct {
	once sync.Once
	dir  string
	g    flusher
	err  error
}

var sharedCluster, sharedSentinel sharedGroup

// shared starts the group once per process (its servers die with the test
// binary: Pdeathsig) and flushes it for each caller.
func shared(tb testing.TB, s *sharedGroup, start func(dir string) (flusher, error)) flusher {
	tb.Helper()
	s.once.Do(func() {
		dir, err := os.MkdirTemp("", "redistest-group-")
		if err != nil {
			s.err = err
			return
		}
		s.dir = dir
		if s.g, s.err = start(dir); s.err != nil {
			_ = os.RemoveAll(dir)
		}
	})
	if s.err != nil {
		tb.Fatalf("redistest: %v", s.err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if err := s.g.FlushAll(ctx); err != nil {
		tb.Fatalf("redistest: flush: %v", err)
	}
	return s.g
}

// Cluster is a Redis Cluster of private redis-servers: masters and their
// replicas on ephemeral ports, created with redis-cli --cluster create.
type Cluster struct {
	Nodes []*Server // masters first at creation; roles change on failover
	dir   string
}

// StartCluster starts a 3-master, 3-replica cluster for tb, stopped in
// tb.Cleanup.
func StartCluster(tb testing.TB) *Cluster {
	tb.Helper()
	c, err := NewCluster(tb.TempDir())
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// NewCluster starts a 3-master, 3-replica cluster under dir. The node
// timeout is 1s, so a killed master's replica is promoted within seconds.
func NewCluster(dir string) (*Cluster, error) {
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, fmt.Errorf("redis-cli not found on PATH (install redis-server's package, redis-tools): %w", err)
	}
	c := &Cluster{dir: dir}
	var addrs []string
	for i := range 6 {
		d := filepath.Join(dir, "node"+strconv.Itoa(i))
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
		// A restarted node resyncs at once (diskless, no 5s wait for more
		// replicas), as a deployment tuned for fast failover does.
		s, err := New(d, WithArgs("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0"))
		if err != nil {
			_ = c.Close()
			return nil, err
		}
		c.Nodes = append(c.Nodes, s)
		addrs = append(addrs, s.Addr())
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("redis-cli --cluster create: %w\n%s", err, out)
	}
	return healthyOrClosed(c)
}

// Addrs are the nodes' host:port addresses.
func (c *Cluster) Addrs() []string {
	return addrsOf(c.Nodes)
}

// URL is the redis+cluster:// URL of the cluster (every node as a seed).
func (c *Cluster) URL() string { return "redis+cluster://" + strings.Join(c.Addrs(), ",") }

// Client returns a cluster client closed in tb.Cleanup.
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), ContextTimeoutEnabled: true})
	tb.Cleanup(func() { _ = cc.Close() })
	return cc
}

// WaitHealthy waits until every running node reports cluster_state:ok,
// every slot is served, and every running replica's link to its master is up.
func (c *Cluster) WaitHealthy(ctx context.Context) error {
	for {
		err := c.healthy(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not healthy: %w", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (c *Cluster) healthy(ctx context.Context) error {
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		rc := redis.NewClient(n.Options())
		info, err := rc.ClusterInfo(ctx).Result()
		if err == nil && !strings.Contains(info, "cluster_state:ok") {
			err = fmt.Errorf("%s: cluster_state not ok", n.Addr())
		}
		if err == nil && !strings.Contains(info, "cluster_slots_ok:16384") {
			err = fmt.Errorf("%s: not every slot served", n.Addr())
		}
		var repl string
		if err == nil {
			repl, err = rc.Info(ctx, "replication").Result()
		}
		_ = rc.Close()
		if err != nil {
			return err
		}
		if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
			return fmt.Errorf("%s: replica link down", n.Addr())
		}
	}
	return nil
}

// MasterOf returns the node serving key's slot now.
func (c *Cluster) MasterOf(ctx context.Context, key string) (*Server, error) {
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		rc := redis.NewClient(n.Options())
		slot, err := rc.ClusterKeySlot(ctx, key).Result()
		var shards []redis.ClusterShard
		if err == nil {
			shards, err = rc.ClusterShards(ctx).Result()
		}
		_ = rc.Close()
		if err != nil {
			continue
		}
		for _, sh := range shards {
			if !slotIn(sh.Slots, slot) {
				continue
			}
			for _, node := range sh.Nodes {
				if node.Role != "master" || node.Health != "online" {
					continue
				}
				addr := net.JoinHostPort(node.IP, strconv.FormatInt(node.Port, 10))
				for _, m := range c.Nodes {
					if m.Addr() == addr {
						return m, nil
					}
				}
			}
		}
	}
	return nil, fmt.Errorf("no node serves the slot of %q", key)
}

// ReplicaOf returns a running replica of master m.
func (c *Cluster) ReplicaOf(ctx context.Context, m *Server) (*Server, error) {
	_, port, _ := strings.Cut(m.Addr(), ":")
	for _, n := range c.Nodes {
		if n == m || !n.Running() {
			continue
		}
		rc := redis.NewClient(n.Options())
		repl, err := rc.Info(ctx, "replication").Result()
		_ = rc.Close()
		if err == nil && strings.Contains(repl, "role:slave") && strings.Contains(repl, "master_port:"+port+"\r\n") {
			return n, nil
		}
	}
	return nil, fmt.Errorf("no replica of %s", m.Addr())
}

func slotIn(ranges []redis.SlotRange, slot int64) bool {
	for _, r := range ranges {
		if r.Start <= slot && slot <= r.End {
			return true
		}
	}
	return false
}

// FlushAll empties every master.
func (c *Cluster) FlushAll(ctx context.Context) error {
	var errs []error
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		rc := redis.NewClient(n.Options())
		role, err := rc.Do(ctx, "ROLE").Slice()
		if err == nil && len(role) > 0 && role[0] == "master" {
			err = rc.FlushAll(ctx).Err()
		}
		_ = rc.Close()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", n.Addr(), err))
		}
	}
	return errors.Join(errs...)
}

// Close kills every node.
func (c *Cluster) Close() error {
	var errs []error
	for _, n := range c.Nodes {
		errs = append(errs, n.Close())
	}
	return errors.Join(errs...)
}

// SentinelGroup is a Sentinel-managed master with one replica and three
// sentinels (redis-server --sentinel), on private ports.
type SentinelGroup struct {
	MasterName string
	Master     *Server // the master at start; after a failover, see MasterAddr
	Replica    *Server
	Sentinels  []*Server
}

// StartSentinel starts a Sentinel group for tb, stopped in tb.Cleanup.
func StartSentinel(tb testing.TB) *SentinelGroup {
	tb.Helper()
	g, err := NewSentinel(tb.TempDir())
	if err != nil {
		tb.Fatalf("redistest: %v", err)
	}
	tb.Cleanup(func() { _ = g.Close() })
	return g
}

// NewSentinel starts a Sentinel group under dir: a master, its replica and
// three sentinels with quorum 2 and down-after 1s.
func NewSentinel(dir string) (*SentinelGroup, error) {
	g := &SentinelGroup{MasterName: "mymaster"}
	sub := func(name string) (string, error) {
		d := filepath.Join(dir, name)
		return d, os.MkdirAll(d, 0o700)
	}
	d, err := sub("master")
	if err != nil {
		return nil, err
	}
	// Either node may be the master after a failover: each resyncs its replica at once
	// (diskless, no 5 s wait for more replicas), as the Cluster nodes do.
	noDelay := []string{"--repl-diskless-sync-delay", "0"}
	if g.Master, err = New(d, WithArgs(noDelay...)); err != nil {
		return nil, err
	}
	if d, err = sub("replica"); err != nil {
		_ = g.Close()
		return nil, err
	}
	host, port, _ := strings.Cut(g.Master.Addr(), ":")
	if g.Replica, err = New(d, WithArgs(append([]string{"--replicaof", host, port}, noDelay...)...)); err != nil {
		_ = g.Close()
		return nil, err
	}
	for i := range 3 {
		if d, err = sub("sentinel" + strconv.Itoa(i)); err != nil {
			_ = g.Close()
			return nil, err
		}
		s, err := New(d, withSentinel(g.MasterName, g.Master.Addr()))
		if err != nil {
			_ = g.Close()
			return nil, err
		}
		g.Sentinels = append(g.Sentinels, s)
	}
	return healthyOrClosed(g)
}

// SentinelAddrs are the sentinels' host:port addresses.
func (g *SentinelGroup) SentinelAddrs() []string {
	return addrsOf(g.Sentinels)
}

// URL is the redis+sentinel:// URL of the group.
func (g *SentinelGroup) URL() string {
	return "redis+sentinel://" + strings.Join(g.SentinelAddrs(), ",") + "/" + g.MasterName
}

// Client returns a failover client closed in tb.Cleanup.
func (g *SentinelGroup) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: g.MasterName, SentinelAddrs: g.SentinelAddrs(), ContextTimeoutEnabled: true})
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// MasterAddr asks the sentinels who the master is now.
func (g *SentinelGroup) MasterAddr(ctx context.Context) (string, error) {
	var last error
	for _, s := range g.Sentinels {
		if !s.Running() {
			continue
		}
		sc := redis.NewSentinelClient(s.Options())
		addr, err := sc.GetMasterAddrByName(ctx, g.MasterName).Result()
		_ = sc.Close()
		if err == nil && len(addr) == 2 {
			return addr[0] + ":" + addr[1], nil
		}
		last = err
	}
	return "", fmt.Errorf("no sentinel names the master: %w", last)
}

// Failover asks a sentinel for a planned failover (SENTINEL FAILOVER).
func (g *SentinelGroup) Failover(ctx context.Context) error {
	sc := redis.NewSentinelClient(g.Sentinels[0].Options())
	defer func() { _ = sc.Close() }()
	return sc.Failover(ctx, g.MasterName).Err()
}

// WaitHealthy waits until every sentinel knows the master, its replica and
// the two other sentinels, and the replica's link is up.
func (g *SentinelGroup) WaitHealthy(ctx context.Context) error {
	for {
		err := g.healthy(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sentinel group not healthy: %w", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (g *SentinelGroup) healthy(ctx context.Context) error {
	for _, s := range g.Sentinels {
		sc := redis.NewSentinelClient(s.Options())
		m, err := sc.Master(ctx, g.MasterName).Result()
		_ = sc.Close()
		if err != nil {
			return err
		}
		if m["num-slaves"] != "1" || m["num-other-sentinels"] != "2" || strings.Contains(m["flags"], "down") {
			return fmt.Errorf("sentinel %s: master %v", s.Addr(), m)
		}
	}
	for _, n := range []*Server{g.Master, g.Replica} {
		rc := redis.NewClient(n.Options())
		repl, err := rc.Info(ctx, "replication").Result()
		_ = rc.Close()
		if err != nil {
			return err
		}
		if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
			return fmt.Errorf("%s: replica link down", n.Addr())
		}
	}
	return nil
}

// FlushAll empties the current master (the replica follows).
func (g *SentinelGroup) FlushAll(ctx context.Context) error {
	addr, err := g.MasterAddr(ctx)
	if err != nil {
		return err
	}
	rc := redis.NewClient(&redis.Options{Addr: addr})
	defer rc.Close()
	return rc.FlushAll(ctx).Err()
}

// Close kills every process of the group.
func (g *SentinelGroup) Close() error {
	var errs []error
	for _, s := range append([]*Server{g.Master, g.Replica}, g.Sentinels...) {
		if s != nil {
			errs = append(errs, s.Close())
		}
	}
	return errors.Join(errs...)
}

// topology is a started group of servers (a Cluster or a SentinelGroup).
type topology interface {
	WaitHealthy(ctx context.Context) error
	Close() error
}

// healthyOrClosed gives t a minute to become healthy; one that does not is
// closed, so a failed start leaves no server running.
func healthyOrClosed[T topology](t T) (T, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := t.WaitHealthy(ctx); err != nil {
		_ = t.Close()
		var zero T
		return zero, err
	}
	return t, nil
}

func addrsOf(servers []*Server) []string {
	out := make([]string, len(servers))
	for i, s := range servers {
		out[i] = s.Addr()
	}
	return out
}
