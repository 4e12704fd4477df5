package grpcserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/logging"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/selector"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/stats"

	"agentplane.dev/pkg/telemetry"
)

// LivenessService is the health service name that is SERVING while the process runs.
const LivenessService = "liveness"

// Defaults applied by New to zero-valued Options fields.
const (
	DefaultMaxRecvMsgSize        = 8 << 20 // ingest batches are ≤ 4 MiB plus framing
	DefaultMaxSendMsgSize        = 8 << 20
	DefaultHealthInterval        = 2 * time.Second
	DefaultHealthTimeout         = time.Second
	DefaultKeepaliveMinTime      = 10 * time.Second // clients may ping at most this often
	DefaultKeepaliveTime         = 30 * time.Second // server pings an idle connection after this
	DefaultKeepaliveTimeout      = 10 * time.Second // and closes it when the ping is not answered
	DefaultMaxConnectionAge      = 30 * time.Minute // spreads clients over new replicas
	DefaultMaxConnectionAgeGrace = 5 * time.Minute  // streams then have this long to finish
	DefaultShutdownTimeout       = 20 * time.Second
)

// Options configure New. Redis and Logger are required; a zero value elsewhere takes the
// default named in the field's comment.
type Options struct {
	Name   string                // service name for logs, e.g. "session"
	Logger *slog.Logger          // required; should carry the "service" attribute (grpcserver does not add it again)
	Redis  redis.UniversalClient // required: readiness is "Redis answers"; closed at shutdown

	Addr     string       // gRPC listen address, used when Listener is nil
	Listener net.Listener // optional, e.g. a bufconn or an already bound port

	MetricsAddr     string               // /metrics HTTP listen address; with no MetricsListener either, no HTTP server
	MetricsListener net.Listener         // optional
	Registry        *prometheus.Registry // where grpc_server_* and process metrics go; nil: a new one (see Server.Registry)

	Telemetry *telemetry.Provider // flushed at shutdown; nil: the global tracer provider, nothing to flush

	InternalToken string                       // bearer token for internal calls; empty disables the check (dev only)
	AuthExempt    func(fullMethod string) bool // methods that authenticate callers themselves
	// Unlisted names services served here that reflection does not list: the
	// services' own calls to each other, which no person calls (the session
	// service's SessionNotifyService beside its public SessionService).
	Unlisted []string

	HealthInterval time.Duration // between Redis PINGs; default 2s
	HealthTimeout  time.Duration // bound on one PING; default 1s

	DrainDelay      time.Duration // between NOT_SERVING and GracefulStop; zero means none
	ShutdownTimeout time.Duration // bound on GracefulStop; default 20s

	MaxRecvMsgSize, MaxSendMsgSize int // default 8 MiB each

	KeepaliveMinTime      time.Duration // default 10s
	KeepaliveTime         time.Duration // default 30s
	KeepaliveTimeout      time.Duration // default 10s
	MaxConnectionAge      time.Duration // default 30m
	MaxConnectionAgeGrace time.Duration // default 5m

	ServerOptions []grpc.ServerOption // appended last, e.g. transport credentials for mTLS

	OnShutdownStep func(ShutdownStep) // observes each shutdown step as it begins
}

// ShutdownStep names one step of the shutdown order.
type ShutdownStep string

// The shutdown steps, in order. StepHardStop happens only when GracefulStop overruns.
const (
	StepNotServing     ShutdownStep = "health_not_serving"
	StepDrain          ShutdownStep = "drain"
	StepGracefulStop   ShutdownStep = "graceful_stop"
	StepHardStop       ShutdownStep = "hard_stop"
	StepCloseRedis     ShutdownStep = "close_redis"
	StepFlushTelemetry ShutdownStep = "flush_telemetry"
	StepStopMetrics    ShutdownStep = "stop_metrics"
)

// Server is a gRPC server with its health, metrics and lifecycle.
type Server struct {
	opts    Options
	log     *slog.Logger
	grpc    *grpc.Server
	health  *health.Server
	metrics *grpcprom.ServerMetrics
	reg     *prometheus.Registry
	codec   *decodeCodec

	serveOnce sync.Once

	// Background work started with Go: its context ends, and Serve waits
	// for it, at the close_redis step.
	background     sync.WaitGroup
	backgroundCtx  context.Context
	stopBackground context.CancelFunc
}

// New builds the server. Register services on it (it is a grpc.ServiceRegistrar), then Serve.
func New(opts Options) (*Server, error) {
	if opts.Logger == nil {
		return nil, errors.New("grpcserver: Options.Logger is required")
	}
	if opts.Redis == nil {
		return nil, errors.New("grpcserver: Options.Redis is required")
	}
	if opts.Listener == nil && opts.Addr == "" {
		return nil, errors.New("grpcserver: Options.Addr or Options.Listener is required")
	}
	if opts.DrainDelay < 0 {
		return nil, errors.New("grpcserver: Options.DrainDelay must not be negative")
	}
	setDefaults(&opts)

	s := &Server{opts: opts, log: opts.Logger.With("component", "grpcserver"), reg: opts.Registry, codec: newDecodeCodec()}
	s.backgroundCtx, s.stopBackground = context.WithCancel(context.Background())
	if s.reg == nil {
		s.reg = prometheus.NewRegistry()
	}
	s.metrics = grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram())
	panics := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "grpc_server_panics_recovered_total",
		Help: "Handler panics turned into INTERNAL by the recovery interceptor.",
	})
	for _, c := range []prometheus.Collector{s.metrics, panics, s.readyGauge(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := s.reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) { // a caller's registry may already have the runtime collectors
				return nil, fmt.Errorf("grpcserver: registering metrics: %w", err)
			}
		}
	}

	notProbe := selector.MatchFunc(func(_ context.Context, c interceptors.CallMeta) bool { return !isProbe(c.FullMethod()) })
	needsAuth := selector.MatchFunc(func(_ context.Context, c interceptors.CallMeta) bool {
		m := c.FullMethod()
		return !isHealth(m) && (opts.AuthExempt == nil || !opts.AuthExempt(m))
	})
	recoveryOpt := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		panics.Inc()
		return s.recovered(ctx, p)
	})
	logOpts := []logging.Option{logging.WithLogOnEvents(logging.FinishCall)}

	// Recovery first; then the method check of restricted listeners
	// (ServeRestricted), before logging and auth: on such a socket nothing
	// else runs for a method it does not serve, token or not.
	unary := []grpc.UnaryServerInterceptor{
		recovery.UnaryServerInterceptor(recoveryOpt),
		restrictUnary,
		selector.UnaryServerInterceptor(logging.UnaryServerInterceptor(slogAdapter(opts.Logger), logOpts...), notProbe),
		s.metrics.UnaryServerInterceptor(),
		s.forgetMalformed,
	}
	stream := []grpc.StreamServerInterceptor{
		recovery.StreamServerInterceptor(recoveryOpt),
		restrictStream,
		selector.StreamServerInterceptor(logging.StreamServerInterceptor(slogAdapter(opts.Logger), logOpts...), notProbe),
		s.metrics.StreamServerInterceptor(),
	}
	if opts.InternalToken != "" {
		check := bearerAuth(opts.InternalToken)
		unary = append(unary, selector.UnaryServerInterceptor(auth.UnaryServerInterceptor(check), needsAuth))
		stream = append(stream, selector.StreamServerInterceptor(auth.StreamServerInterceptor(check), needsAuth))
	} else {
		s.log.Warn("internal auth disabled: no internal token configured (dev only)")
	}
	unary = append(unary, s.validateUnary)
	stream = append(stream, s.validateStream)

	otelOpts := []otelgrpc.Option{
		otelgrpc.WithFilter(func(info *stats.RPCTagInfo) bool { return !isProbe(info.FullMethodName) }),
		// W3C trace context even when telemetry.Setup was not called (tests, embedding), so
		// the caller's trace id still reaches the logs.
		otelgrpc.WithPropagators(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
	}
	if opts.Telemetry != nil {
		otelOpts = append(otelOpts, otelgrpc.WithTracerProvider(opts.Telemetry.TracerProvider()))
	}
	serverOpts := append([]grpc.ServerOption{
		grpc.StatsHandler(otelgrpc.NewServerHandler(otelOpts...)),
		grpc.ForceServerCodecV2(s.codec),
		grpc.ChainUnaryInterceptor(unary...),
		grpc.ChainStreamInterceptor(stream...),
		grpc.MaxRecvMsgSize(opts.MaxRecvMsgSize),
		grpc.MaxSendMsgSize(opts.MaxSendMsgSize),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             opts.KeepaliveMinTime,
			PermitWithoutStream: true, // idle wrapper and peer connections keep themselves alive
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time:                  opts.KeepaliveTime,
			Timeout:               opts.KeepaliveTimeout,
			MaxConnectionAge:      opts.MaxConnectionAge,
			MaxConnectionAgeGrace: opts.MaxConnectionAgeGrace,
		}),
	}, opts.ServerOptions...)
	s.grpc = grpc.NewServer(serverOpts...)

	s.health = health.NewServer()
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING) // not ready before Redis answers
	healthpb.RegisterHealthServer(s.grpc, s.health)
	reflectionpb.RegisterServerReflectionServer(s.grpc, reflection.NewServerV1(reflection.ServerOptions{
		Services: listed{s.grpc, opts.Unlisted}}))
	return s, nil
}

// listed is the server's services less the unlisted ones, for reflection.
type listed struct {
	all      reflection.ServiceInfoProvider
	unlisted []string
}

func (l listed) GetServiceInfo() map[string]grpc.ServiceInfo {
	m := l.all.GetServiceInfo()
	for _, name := range l.unlisted {
		delete(m, name)
	}
	return m
}

func setDefaults(o *Options) {
	def := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.HealthInterval, DefaultHealthInterval)
	def(&o.HealthTimeout, DefaultHealthTimeout)
	def(&o.ShutdownTimeout, DefaultShutdownTimeout)
	def(&o.KeepaliveMinTime, DefaultKeepaliveMinTime)
	def(&o.KeepaliveTime, DefaultKeepaliveTime)
	def(&o.KeepaliveTimeout, DefaultKeepaliveTimeout)
	def(&o.MaxConnectionAge, DefaultMaxConnectionAge)
	def(&o.MaxConnectionAgeGrace, DefaultMaxConnectionAgeGrace)
	if o.MaxRecvMsgSize <= 0 {
		o.MaxRecvMsgSize = DefaultMaxRecvMsgSize
	}
	if o.MaxSendMsgSize <= 0 {
		o.MaxSendMsgSize = DefaultMaxSendMsgSize
	}
}

// isProbe reports whether a method belongs to health or reflection, which are not logged
// and not traced.
func isProbe(fullMethod string) bool {
	return isHealth(fullMethod) || strings.HasPrefix(fullMethod, "/grpc.reflection.")
}

// isHealth reports whether a method belongs to health, the one service exempt from auth:
// probes carry no token. Reflection lists the internal services, so it needs the token
// when one is configured (grpcurl -H 'authorization: Bearer <token>').
func isHealth(fullMethod string) bool {
	return strings.HasPrefix(fullMethod, "/"+healthpb.Health_ServiceDesc.ServiceName+"/")
}

// slogAdapter is the go-grpc-middleware logging adapter; records keep the call's context so
// the logging handler adds trace_id/span_id.
func slogAdapter(l *slog.Logger) logging.Logger {
	return logging.LoggerFunc(func(ctx context.Context, lvl logging.Level, msg string, fields ...any) {
		l.Log(ctx, slog.Level(lvl), msg, fields...)
	})
}

// RegisterService implements grpc.ServiceRegistrar.
func (s *Server) RegisterService(desc *grpc.ServiceDesc, impl any) {
	s.grpc.RegisterService(desc, impl)
}

// GRPC returns the underlying server, e.g. for GetServiceInfo.
func (s *Server) GRPC() *grpc.Server { return s.grpc }

// Registry returns the Prometheus registry served on /metrics, for a service's own collectors.
func (s *Server) Registry() *prometheus.Registry { return s.reg }

// Serve listens, serves until ctx ends or serving fails, then shuts down in the documented
// order. It returns nil after a clean shutdown that ctx asked for. Call it once.
func (s *Server) Serve(ctx context.Context) error {
	err := errors.New("grpcserver: Serve called twice")
	s.serveOnce.Do(func() {
		err = s.serve(ctx)
		s.endBackground() // also when Serve failed before any shutdown
	})
	return err
}

// Go runs f, the service's own background work (loops that write Redis,
// a second listener), for the life of the server. f's context ends at the
// close_redis step of the shutdown, after the last gRPC call, and the step
// waits for f to return before Redis closes, so f's last writes still land
// (docs/decisions.md #19). It also ends when Serve returns without a
// shutdown. Call Go before Serve.
func (s *Server) Go(f func(ctx context.Context)) {
	s.background.Go(func() { f(s.backgroundCtx) })
}

func (s *Server) endBackground() {
	s.stopBackground()
	s.background.Wait()
}

func (s *Server) serve(ctx context.Context) error {
	lis := s.opts.Listener
	if lis == nil {
		var err error
		if lis, err = net.Listen("tcp", s.opts.Addr); err != nil {
			return fmt.Errorf("grpcserver: listen %s: %w", s.opts.Addr, err)
		}
	}
	mlis := s.opts.MetricsListener
	if mlis == nil && s.opts.MetricsAddr != "" {
		var err error
		if mlis, err = net.Listen("tcp", s.opts.MetricsAddr); err != nil {
			_ = lis.Close()
			return fmt.Errorf("grpcserver: listen metrics %s: %w", s.opts.MetricsAddr, err)
		}
	}

	var wg sync.WaitGroup
	defer wg.Wait()

	var metricsSrv *http.Server
	if mlis != nil {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{Registry: s.reg}))
		metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		wg.Go(func() {
			if err := metricsSrv.Serve(mlis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log.Error("metrics server stopped", "error", err)
			}
		})
	}

	s.metrics.InitializeMetrics(s.grpc)
	s.health.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	checkCtx, stopCheck := context.WithCancel(context.WithoutCancel(ctx))
	defer stopCheck()
	mirrored := s.mirroredServices()
	for _, name := range mirrored { // known (not ready) from the start, never "unknown service"
		s.health.SetServingStatus(name, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	wg.Go(func() { s.checkRedis(checkCtx, mirrored) })

	serveErr := make(chan error, 1)
	wg.Go(func() { serveErr <- s.grpc.Serve(lis) })
	s.log.Info("serving", "grpc_addr", lis.Addr().String(), "metrics", mlis != nil)

	var err error
	select {
	case <-ctx.Done():
	case err = <-serveErr:
		err = fmt.Errorf("grpcserver: serve: %w", err)
	}
	s.shutdown(stopCheck, metricsSrv)
	return err
}

func (s *Server) step(st ShutdownStep) {
	s.log.Info("shutdown", "step", string(st))
	if s.opts.OnShutdownStep != nil {
		s.opts.OnShutdownStep(st)
	}
}

func (s *Server) shutdown(stopCheck func(), metricsSrv *http.Server) {
	s.step(StepNotServing)
	stopCheck()
	s.health.Shutdown() // every service NOT_SERVING, and later updates are ignored

	s.step(StepDrain)
	if s.opts.DrainDelay > 0 {
		time.Sleep(s.opts.DrainDelay)
	}

	s.step(StepGracefulStop)
	stopped := make(chan struct{})
	go func() { s.grpc.GracefulStop(); close(stopped) }()
	bound := time.NewTimer(s.opts.ShutdownTimeout)
	select {
	case <-stopped:
		bound.Stop()
	case <-bound.C:
		s.step(StepHardStop)
		s.grpc.Stop() // cancels remaining streams; GracefulStop then returns too
		<-stopped
	}

	s.step(StepCloseRedis)
	s.endBackground()
	if err := s.opts.Redis.Close(); err != nil && !errors.Is(err, redis.ErrClosed) {
		s.log.Warn("closing redis", "error", err)
	}

	flushCtx, cancel := context.WithTimeout(context.Background(), s.opts.ShutdownTimeout)
	defer cancel()
	s.step(StepFlushTelemetry)
	if err := s.opts.Telemetry.Shutdown(flushCtx); err != nil {
		s.log.Warn("flushing telemetry", "error", err)
	}

	s.step(StepStopMetrics)
	if metricsSrv != nil {
		if err := metricsSrv.Shutdown(flushCtx); err != nil {
			s.log.Warn("stopping metrics server", "error", err)
		}
	}
}
