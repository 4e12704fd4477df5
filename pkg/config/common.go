package config

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/redis/go-redis/v9"

	"agentplane.dev/pkg/logging"
	"agentplane.dev/pkg/replication"
)

// Common is the configuration every service embeds (docs/development.md lists the names).
type Common struct {
	RedisURL            string        // REDIS_URL (secret: may carry a password): see Redis for the accepted forms
	RedisPassword       string        // REDIS_PASSWORD (secret): overrides the URL's password; how the chart passes it
	RedisMinReplicas    int           // REDIS_MIN_REPLICAS: replicas that must have a write before it is acknowledged (WAIT); 0: none
	RedisReplicaTimeout time.Duration // REDIS_REPLICA_TIMEOUT: bound on each WAIT for REDIS_MIN_REPLICAS
	GRPCAddr            string        // GRPC_ADDR: host:port of the gRPC listener
	MetricsAddr         string        // METRICS_ADDR: host:port of the /metrics HTTP listener; empty disables it
	InternalToken       string        // INTERNAL_TOKEN (secret): service-to-service bearer token; empty disables the check (dev only)
	DrainDelay          time.Duration // DRAIN_DELAY: time between NOT_SERVING and stopping, for load balancers to notice
	ShutdownTimeout     time.Duration // SHUTDOWN_TIMEOUT: bound on GracefulStop before a hard stop
	LogLevel            slog.Level    // LOG_LEVEL: debug, info, warn, error
	LogFormat           string        // LOG_FORMAT: json or text

	plainSecrets []PlainSecret // secrets given as values, not files: Logger warns about them
}

// DefaultCommon returns the defaults for a service listening on grpcAddr and metricsAddr.
func DefaultCommon(grpcAddr, metricsAddr string) Common {
	return Common{
		GRPCAddr:            grpcAddr,
		MetricsAddr:         metricsAddr,
		RedisReplicaTimeout: time.Second,
		DrainDelay:          5 * time.Second,
		ShutdownTimeout:     20 * time.Second,
		LogLevel:            slog.LevelInfo,
		LogFormat:           string(logging.JSON),
	}
}

// Bind registers the common settings on l, with c's current values as defaults. Once l has
// parsed, c knows which secrets of every setting bound on l (the service's own too) were given
// as values rather than files, and Logger warns about them.
func (c *Common) Bind(l *Loader) {
	l.Secret(&c.RedisURL, "REDIS_URL", c.RedisURL, "Redis URL: redis://, rediss://, unix://, redis+sentinel://, redis+cluster://")
	l.Secret(&c.RedisPassword, "REDIS_PASSWORD", c.RedisPassword, "Redis password, used instead of the URL's")
	l.Int(&c.RedisMinReplicas, "REDIS_MIN_REPLICAS", c.RedisMinReplicas, "Redis replicas that must have a write before it is acknowledged (WAIT); 0: no WAIT (single Redis)")
	l.Duration(&c.RedisReplicaTimeout, "REDIS_REPLICA_TIMEOUT", c.RedisReplicaTimeout, "bound on each WAIT for REDIS_MIN_REPLICAS; a write not confirmed within it answers UNAVAILABLE")
	l.String(&c.GRPCAddr, "GRPC_ADDR", c.GRPCAddr, "gRPC listen address")
	l.String(&c.MetricsAddr, "METRICS_ADDR", c.MetricsAddr, "Prometheus /metrics listen address; empty disables it")
	l.Secret(&c.InternalToken, "INTERNAL_TOKEN", c.InternalToken, "service-to-service bearer token; empty disables the check (dev only)")
	l.Duration(&c.DrainDelay, "DRAIN_DELAY", c.DrainDelay, "delay between reporting NOT_SERVING and stopping")
	l.Duration(&c.ShutdownTimeout, "SHUTDOWN_TIMEOUT", c.ShutdownTimeout, "bound on graceful stop before a hard stop")
	level := c.LogLevel
	l.TextVar(&c.LogLevel, "LOG_LEVEL", level, "log level: debug, info, warn, error")
	l.String(&c.LogFormat, "LOG_FORMAT", c.LogFormat, "log format: json or text")
	l.parsed = append(l.parsed, func() {
		c.plainSecrets = nil
		for _, s := range l.PlainSecrets() {
			// A Redis URL is a secret only when it carries credentials.
			if s.Name != "REDIS_URL" || redisURLHasUserinfo(c.RedisURL) {
				c.plainSecrets = append(c.plainSecrets, s)
			}
		}
	})
}

// Validate checks every common setting and returns all problems at once, each naming its
// variable and flag.
func (c *Common) Validate() error {
	var errs []error
	bad := func(name string, err error) { errs = append(errs, ErrorFor(name, err)) }

	if c.RedisURL == "" {
		bad("REDIS_URL", errors.New("required"))
	} else if _, err := parseRedisURL(c.RedisURL, c.RedisPassword); err != nil {
		bad("REDIS_URL", err)
	}
	if c.RedisMinReplicas < 0 || c.RedisMinReplicas > maxMinReplicas {
		bad("REDIS_MIN_REPLICAS", fmt.Errorf("want 0 to %d", maxMinReplicas))
	}
	// The WAIT's reply must come before go-redis' default 3s read timeout.
	if c.RedisReplicaTimeout <= 0 || c.RedisReplicaTimeout > maxReplicaTimeout {
		bad("REDIS_REPLICA_TIMEOUT", fmt.Errorf("want a duration above 0 and at most %s", maxReplicaTimeout))
	}
	if err := checkAddr(c.GRPCAddr); err != nil {
		bad("GRPC_ADDR", err)
	}
	if c.MetricsAddr != "" {
		if err := checkAddr(c.MetricsAddr); err != nil {
			bad("METRICS_ADDR", err)
		}
	}
	if c.DrainDelay < 0 {
		bad("DRAIN_DELAY", errors.New("must not be negative"))
	}
	if c.ShutdownTimeout <= 0 {
		bad("SHUTDOWN_TIMEOUT", errors.New("must be positive"))
	}
	if _, err := logging.ParseFormat(c.LogFormat); err != nil {
		bad("LOG_FORMAT", err)
	}
	return errors.Join(errs...)
}

// Logger builds the process logger from LogFormat and LogLevel (call after Validate, once at
// start) and warns on it about each secret given as a value rather than a file.
func (c *Common) Logger() *slog.Logger {
	f, _ := logging.ParseFormat(c.LogFormat)
	log := logging.New(os.Stderr, f, c.LogLevel)
	for _, s := range c.plainSecrets {
		env, _ := Names(s.Name)
		log.Warn(s.Warning(), "setting", env)
	}
	return log
}

// PlainSecrets lists the secrets the loader found given as values rather than files.
func (c *Common) PlainSecrets() []PlainSecret { return c.plainSecrets }

// Bounds of REDIS_MIN_REPLICAS and REDIS_REPLICA_TIMEOUT.
const (
	maxMinReplicas    = 16
	maxReplicaTimeout = 2 * time.Second
)

// Redis returns a client for RedisURL, with RedisPassword (when set) as the password, that
// confirms each write on RedisMinReplicas replicas (pkg/replication) before it succeeds.
func (c *Common) Redis() (redis.UniversalClient, error) {
	newClient, err := parseRedisURL(c.RedisURL, c.RedisPassword)
	if err != nil {
		return nil, err
	}
	rdb := newClient()
	replication.Require(rdb, replication.Policy{Replicas: c.RedisMinReplicas, Timeout: c.RedisReplicaTimeout})
	return rdb, nil
}

func checkAddr(addr string) error {
	if addr == "" {
		return errors.New("required")
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return fmt.Errorf("want host:port: %w", err)
	}
	return nil
}
