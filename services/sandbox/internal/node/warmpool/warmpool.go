// Package warmpool keeps this node's warm pool filled (DESIGN.md 3.8): per
// agent profile, a configured number of pooled wrappers (the provider's
// provider.Pool), started with the boundary and their agent, bound to no
// sandbox and no tenant, for routes at the pool's directory. A route that
// launches a fresh runtime key of the same shape claims one instead of
// starting cold; the pool refills behind it, one sandbox at a time, and only
// while the node keeps the free space routes need (so a pool never takes a
// tenant's room). The claim itself is the provider's (one runtime key, once).
package warmpool

import (
	"context"
	"errors"
	"log/slog"
	"sort"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/pkg/pause"
	"agentplane.dev/services/sandbox/internal/agent/agents"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// ReasonAgentUnavailable is what a pool of a profile that is not installed
// reports at start (errors.md AGENT_UNAVAILABLE); it stays empty.
const ReasonAgentUnavailable = "AGENT_UNAVAILABLE"

// Config of a warm pool.
type Config struct {
	// Sizes is the number of pooled sandboxes per agent profile (0: none).
	Sizes map[string]int
	// Directory is where pooled sandboxes present their worktree: a route
	// at another directory launches cold.
	Directory string
	// Shape is the launch a profile's pooled wrappers share with routes
	// (driver.PoolShape).
	Shape func(profile, directory string) (provider.LaunchSpec, error)
	// Room (required) measures the sandbox root's free bytes. ReserveBytes: the pool
	// refills only while the root keeps at least this much free (the
	// capacity threshold a cold route needs), so a route never finds its
	// room taken by the pool.
	Room         provider.RootMeter
	ReserveBytes uint64
	// Every is how often the pool checks its size (default 500 ms); a
	// claim is noticed at the next check.
	Every  time.Duration
	Logger *slog.Logger
}

// Pool fills a provider's pool.
type Pool struct {
	cfg     Config
	prov    provider.Pool
	metrics *Metrics
	// failed counts each profile's failed starts in a row: its next start
	// waits Every × 2^failed (at most a minute), so a pool that cannot
	// start does not retry, and log, twice a second.
	failed  map[string]int
	retryAt map[string]time.Time
}

// New builds a pool over prov; m may be nil.
func New(cfg Config, prov provider.Pool, m *Metrics) *Pool {
	if cfg.Every <= 0 {
		cfg.Every = 500 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if m == nil {
		m = NewMetrics()
	}
	prov.SetPoolObserver(m)
	return &Pool{cfg: cfg, prov: prov, metrics: m, failed: map[string]int{}, retryAt: map[string]time.Time{}}
}

// Run sweeps what an earlier incarnation's pool left, keeps the pool
// filled until ctx ends, then drains it.
func (p *Pool) Run(ctx context.Context) {
	if err := p.prov.SweepPool(ctx); err != nil {
		p.cfg.Logger.Warn("pooled sandboxes of an earlier run not all verified gone", "err", err)
	}
	shapes := p.shapes()
	defer p.prov.DrainPool(context.WithoutCancel(ctx))
	for {
		p.fill(ctx, shapes)
		if pause.Sleep(ctx, p.cfg.Every) != nil {
			return
		}
	}
}

// shapes resolves each configured profile once: a profile that is not
// installed is reported now and never filled.
func (p *Pool) shapes() map[string]provider.LaunchSpec {
	out := map[string]provider.LaunchSpec{}
	for profile, n := range p.cfg.Sizes {
		if n <= 0 {
			continue
		}
		spec, err := p.cfg.Shape(profile, p.cfg.Directory)
		if err != nil {
			reason := "shape"
			if errors.Is(err, agents.ErrUnavailable) {
				reason = ReasonAgentUnavailable
			}
			p.cfg.Logger.Error("warm pool stays empty", "profile", profile, "reason", reason, "err", err)
			p.metrics.unavailable.WithLabelValues(profile).Set(1)
			continue
		}
		out[profile] = spec
	}
	return out
}

// fill starts pooled sandboxes one at a time, in profile order, until each
// profile has its size or the node's free space falls to the reserve.
func (p *Pool) fill(ctx context.Context, shapes map[string]provider.LaunchSpec) {
	profiles := make([]string, 0, len(shapes))
	for profile := range shapes {
		profiles = append(profiles, profile)
	}
	sort.Strings(profiles)
	for _, profile := range profiles {
		if time.Now().Before(p.retryAt[profile]) {
			continue
		}
		for pooled(p.prov.PoolSize()[profile]) < p.cfg.Sizes[profile] && ctx.Err() == nil {
			if !p.room() {
				p.metrics.deferred.Inc()
				return
			}
			start := time.Now()
			if err := p.prov.FillPool(ctx, profile, shapes[profile]); err != nil {
				p.cfg.Logger.Warn("pooled sandbox not started", "profile", profile, "err", err)
				p.metrics.failures.WithLabelValues(profile).Inc()
				p.failed[profile]++
				p.retryAt[profile] = time.Now().Add(min(time.Minute, p.cfg.Every<<min(p.failed[profile], 10)))
				break
			}
			p.failed[profile] = 0
			p.metrics.refill.WithLabelValues(profile).Observe(time.Since(start).Seconds())
		}
	}
}

// pooled counts a profile's pooled sandboxes, claimable or still starting.
func pooled(c provider.PoolCount) int { return c.Ready + c.Starting }

// room reports whether the sandbox root has more free space than the
// reserve routes need; unmeasurable is no room.
func (p *Pool) room() bool {
	c := p.cfg.Room.RootCapacity()
	return c.Kind == provider.CapacityMeasured && c.AvailableBytes > p.cfg.ReserveBytes
}

// Metrics of the warm pool.
type Metrics struct {
	unavailable *prometheus.GaugeVec
	claimed     *prometheus.CounterVec
	misses      *prometheus.CounterVec
	failures    *prometheus.CounterVec
	deferred    prometheus.Counter
	refill      *prometheus.HistogramVec
}

// NewMetrics builds the pool's metrics (Register puts them on a registry).
func NewMetrics() *Metrics {
	return &Metrics{
		claimed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "agentplane_sandbox_pool_claims_total",
			Help: "Fresh runtime keys that took a pooled sandbox, by agent profile."}, []string{"profile"}),
		misses: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "agentplane_sandbox_pool_misses_total",
			Help: "Launches of a pooled shape that started cold, by agent profile and reason (empty, starting, not_fresh, claim)."}, []string{"profile", "reason"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "agentplane_sandbox_pool_start_failures_total",
			Help: "Pooled sandboxes that could not be started, by agent profile."}, []string{"profile"}),
		deferred: prometheus.NewCounter(prometheus.CounterOpts{Name: "agentplane_sandbox_pool_refills_deferred_total",
			Help: "Refills put off because the sandbox root had no room beyond what routes need."}),
		unavailable: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "agentplane_sandbox_pool_unavailable",
			Help: "1 for a configured pool whose agent profile is not installed (AGENT_UNAVAILABLE): it stays empty."}, []string{"profile"}),
		refill: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "agentplane_sandbox_pool_refill_seconds",
			Help:    "Time to start one pooled sandbox (boundary and wrapper; its agent starts behind it), by agent profile.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}}, []string{"profile"}),
	}
}

// Claimed counts a claim (provider.PoolObserver).
func (m *Metrics) Claimed(label string) { m.claimed.WithLabelValues(label).Inc() }

// Missed counts a miss (provider.PoolObserver).
func (m *Metrics) Missed(label string, why provider.PoolMiss) {
	m.misses.WithLabelValues(label, string(why)).Inc()
}

// Register puts the pool's metrics on reg, with its size read from the
// provider at scrape.
func (p *Pool) Register(reg prometheus.Registerer) error {
	size := prometheus.NewDesc("agentplane_sandbox_pool_size", "Pooled sandboxes ready for a claim, by agent profile.", []string{"profile"}, nil)
	starting := prometheus.NewDesc("agentplane_sandbox_pool_starting", "Pooled sandboxes started but not yet ready for a claim, by agent profile.", []string{"profile"}, nil)
	return errors.Join(
		reg.Register(p.metrics.claimed), reg.Register(p.metrics.misses), reg.Register(p.metrics.failures),
		reg.Register(p.metrics.deferred), reg.Register(p.metrics.unavailable), reg.Register(p.metrics.refill),
		reg.Register(sizeCollector{size: size, starting: starting, pool: p}),
	)
}

type sizeCollector struct {
	size, starting *prometheus.Desc
	pool           *Pool
}

func (c sizeCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.size; ch <- c.starting }

func (c sizeCollector) Collect(ch chan<- prometheus.Metric) {
	got := c.pool.prov.PoolSize()
	for profile, n := range c.pool.cfg.Sizes {
		if n > 0 {
			ch <- prometheus.MustNewConstMetric(c.size, prometheus.GaugeValue, float64(got[profile].Ready), profile)
			ch <- prometheus.MustNewConstMetric(c.starting, prometheus.GaugeValue, float64(got[profile].Starting), profile)
		}
	}
}
