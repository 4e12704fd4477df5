// Package server runs the credential service: the gRPC CredentialService and
// the HTTP credential proxy, from one Config. cmd/credential and
// cmd/agentplane both start it through Run.
package server

import (
	"agentplane.dev/pkg/telemetry"
	"context"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"agentplane.dev/pkg/grpcclient"

	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/egresspolicy"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcserver"
	"agentplane.dev/services/credential/attestation"
	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/grpcapi"
	"agentplane.dev/services/credential/internal/proxy"
	"agentplane.dev/services/credential/internal/scope"
	"agentplane.dev/services/credential/internal/sealer"
)

// Config is the credential service's configuration.
type Config struct {
	config.Common
	CredentialKey    string        // CREDENTIAL_KEY (secret): base64 32-byte AES-256-GCM key for secrets at rest; empty: random per process (dev)
	AttestationKey   string        // ATTESTATION_KEY (secret): base64 HMAC key (≥ 32 bytes) shared with upstreams; empty: random per process (dev)
	ProxyAddr        string        // PROXY_ADDR: HTTP listen address of the credential proxy
	ProviderUpstream string        // PROVIDER_UPSTREAM: base URL of the OpenAI-compatible provider; empty disables the route
	BackendUpstream  string        // BACKEND_UPSTREAM: base URL of the backend; empty disables the route
	IngestAddr       string        // INGEST_ADDR: gRPC address of the ingest service
	SessionAddr      string        // SESSION_ADDR: gRPC address of the session service, for usage reports; empty: not reported
	ProviderMethods  string        // PROXY_PROVIDER_METHODS: methods the provider route forwards (comma-separated)
	ProviderHeaders  string        // PROXY_PROVIDER_HEADERS: request headers the provider route forwards
	BackendMethods   string        // PROXY_BACKEND_METHODS: methods the backend route forwards
	BackendHeaders   string        // PROXY_BACKEND_HEADERS: request headers the backend route forwards
	GitNetworks      string        // PROXY_GIT_PRIVATE_NETWORKS: networks the git route may dial although the address policy refuses them; empty (the default): none
	OverlapWindow    time.Duration // OVERLAP_WINDOW: how long a rotated-out handle still resolves
	GrantTTL         time.Duration // GRANT_TTL: lifetime of a grant
	ReissueBelow     time.Duration // GRANT_REISSUE_BELOW: re-issue on delivery when less remains
	TrustWindow      time.Duration // RESOLUTION_TRUST_WINDOW: how long the proxy uses a cached resolution without Redis; revoking calls wait this long (+10%)
	ResolveBudget    time.Duration // PROXY_RESOLVE_BUDGET: how long a proxied request retries resolving its handle while Redis is unavailable
}

// DefaultConfig returns the dev defaults (ports from docs/development.md).
func DefaultConfig() Config {
	return Config{
		Common:          config.DefaultCommon("127.0.0.1:7403", "127.0.0.1:9403"),
		ProxyAddr:       "127.0.0.1:7405",
		IngestAddr:      "127.0.0.1:7404",
		SessionAddr:     "127.0.0.1:7401",
		ProviderMethods: strings.Join(proxy.DefaultProviderPolicy.Methods, ","),
		ProviderHeaders: strings.Join(proxy.DefaultProviderPolicy.Headers, ","),
		BackendMethods:  strings.Join(proxy.DefaultBackendPolicy.Methods, ","),
		BackendHeaders:  strings.Join(proxy.DefaultBackendPolicy.Headers, ","),
		OverlapWindow:   5 * time.Minute,
		GrantTTL:        4 * time.Hour,
		ReissueBelow:    time.Hour,
		TrustWindow:     25 * time.Millisecond,
		ResolveBudget:   10 * time.Second,
	}
}

// Bind registers every setting on l with c's values as defaults.
func (c *Config) Bind(l *config.Loader) {
	c.Common.Bind(l)
	l.Secret(&c.CredentialKey, "CREDENTIAL_KEY", c.CredentialKey, "base64 32-byte key encrypting backing credentials at rest; empty: a random key per process (dev only)")
	l.Secret(&c.AttestationKey, "ATTESTATION_KEY", c.AttestationKey, "base64 HMAC key (at least 32 bytes) for proxy attestations; empty: a random key per process (dev only)")
	l.String(&c.ProxyAddr, "PROXY_ADDR", c.ProxyAddr, "credential proxy HTTP listen address")
	l.String(&c.ProviderUpstream, "PROVIDER_UPSTREAM", c.ProviderUpstream, "OpenAI-compatible provider base URL for the provider/* route; empty disables it")
	l.String(&c.BackendUpstream, "BACKEND_UPSTREAM", c.BackendUpstream, "backend base URL for the backend/* route; empty disables it")
	l.String(&c.IngestAddr, "INGEST_ADDR", c.IngestAddr, "ingest service gRPC address for the ingest/* route; "+config.PeerAddrHelp)
	l.String(&c.SessionAddr, "SESSION_ADDR", c.SessionAddr, "session service gRPC address the proxy reports provider token usage to; empty: usage is read but not reported; "+config.PeerAddrHelp)
	l.String(&c.ProviderMethods, "PROXY_PROVIDER_METHODS", c.ProviderMethods, "comma-separated methods the provider/* route forwards (others: 405); TRACE and CONNECT are never allowed")
	l.String(&c.ProviderHeaders, "PROXY_PROVIDER_HEADERS", c.ProviderHeaders, "comma-separated request headers the provider/* route forwards (a trailing * matches a prefix); others are dropped")
	l.String(&c.BackendMethods, "PROXY_BACKEND_METHODS", c.BackendMethods, "comma-separated methods the backend/* route forwards (others: 405); TRACE and CONNECT are never allowed")
	l.String(&c.BackendHeaders, "PROXY_BACKEND_HEADERS", c.BackendHeaders, "comma-separated request headers the backend/* route forwards (a trailing * matches a prefix); others are dropped")
	l.String(&c.GitNetworks, "PROXY_GIT_PRIVATE_NETWORKS", c.GitNetworks, "comma-separated CIDRs or addresses the git/* route may dial although they are private, loopback, link-local or reserved (an in-house git server); empty: none, every such address and its IPv6 forms is refused")
	l.Duration(&c.OverlapWindow, "OVERLAP_WINDOW", c.OverlapWindow, "how long a rotated-out handle still resolves")
	l.Duration(&c.GrantTTL, "GRANT_TTL", c.GrantTTL, "lifetime of a handle grant")
	l.Duration(&c.ReissueBelow, "GRANT_REISSUE_BELOW", c.ReissueBelow, "re-issue a grant on delivery when less than this remains")
	l.Duration(&c.ResolveBudget, "PROXY_RESOLVE_BUDGET", c.ResolveBudget, "how long a proxied request retries resolving its handle while Redis is unavailable (a failover), within the request's own deadline; 0: no retry")
	l.Duration(&c.TrustWindow, "RESOLUTION_TRUST_WINDOW", c.TrustWindow, "how long the proxy uses a cached handle resolution without Redis; every revoking call waits this long plus 10% before it returns (0: no cache)")
}

// Validate checks every setting and names the variable and flag of each bad one.
func (c *Config) Validate() error {
	var errs []error
	if err := c.Common.Validate(); err != nil {
		errs = append(errs, err)
	}
	bad := func(name string, err error) { errs = append(errs, config.ErrorFor(name, err)) }
	if c.CredentialKey != "" {
		if _, err := sealer.ParseKey(c.CredentialKey); err != nil {
			bad("CREDENTIAL_KEY", err)
		}
	}
	if c.AttestationKey != "" {
		if _, err := parseAttestationKey(c.AttestationKey); err != nil {
			bad("ATTESTATION_KEY", err)
		}
	}
	if _, _, err := net.SplitHostPort(c.ProxyAddr); err != nil {
		bad("PROXY_ADDR", fmt.Errorf("want host:port: %w", err))
	}
	for name, v := range map[string]string{"PROVIDER_UPSTREAM": c.ProviderUpstream, "BACKEND_UPSTREAM": c.BackendUpstream} {
		if _, err := parseUpstream(v); err != nil {
			bad(name, err)
		}
	}
	if err := config.CheckPeerAddr("INGEST_ADDR", c.IngestAddr, true); err != nil {
		errs = append(errs, err)
	}
	if err := config.CheckPeerAddr("SESSION_ADDR", c.SessionAddr, false); err != nil {
		errs = append(errs, err)
	}
	if c.ResolveBudget < 0 {
		bad("PROXY_RESOLVE_BUDGET", errors.New("must not be negative"))
	}
	if _, _, err := c.policies(); err != nil {
		errs = append(errs, err)
	}
	if _, err := c.gitNetworks(); err != nil {
		errs = append(errs, err)
	}
	if c.OverlapWindow < 0 {
		bad("OVERLAP_WINDOW", errors.New("must not be negative"))
	}
	if c.TrustWindow < 0 || c.TrustWindow > time.Second {
		bad("RESOLUTION_TRUST_WINDOW", errors.New("must be between 0 and 1s (revoking calls wait it out)"))
	}
	if c.GrantTTL <= 0 {
		bad("GRANT_TTL", errors.New("must be positive"))
	}
	if c.ReissueBelow < 0 || c.ReissueBelow >= c.GrantTTL {
		bad("GRANT_REISSUE_BELOW", errors.New("must be at least 0 and below GRANT_TTL"))
	}
	return errors.Join(errs...)
}

// LoadConfig reads flags and AGENTPLANE_* variables over the defaults.
func LoadConfig(args []string, lookupEnv func(string) (string, bool)) (Config, error) {
	cfg := DefaultConfig()
	fs := flag.NewFlagSet("credential", flag.ContinueOnError)
	l := config.NewLoader(fs, lookupEnv)
	cfg.Bind(l)
	if err := l.Parse(args); err != nil {
		return cfg, err
	}
	return cfg, cfg.Validate()
}

// policies parses the proxy routes' allowlists; an error names the setting.
func (c *Config) policies() (provider, backend proxy.RoutePolicy, err error) {
	var errs []error
	parse := func(name, v string, f func(string) ([]string, error), dst *[]string) {
		var perr error
		if *dst, perr = f(v); perr != nil {
			errs = append(errs, config.ErrorFor(name, perr))
		}
	}
	parse("PROXY_PROVIDER_METHODS", c.ProviderMethods, proxy.ParseMethods, &provider.Methods)
	parse("PROXY_PROVIDER_HEADERS", c.ProviderHeaders, proxy.ParseHeaders, &provider.Headers)
	parse("PROXY_BACKEND_METHODS", c.BackendMethods, proxy.ParseMethods, &backend.Methods)
	parse("PROXY_BACKEND_HEADERS", c.BackendHeaders, proxy.ParseHeaders, &backend.Headers)
	return provider, backend, errors.Join(errs...)
}

// gitNetworks parses PROXY_GIT_PRIVATE_NETWORKS (egress's
// private_networks syntax).
func (c *Config) gitNetworks() ([]string, error) {
	var nets []string
	for n := range strings.SplitSeq(c.GitNetworks, ",") {
		if n = strings.TrimSpace(n); n != "" {
			nets = append(nets, n)
		}
	}
	if probs := (egresspolicy.Policy{PrivateNetworks: nets}).Validate(0); len(probs) > 0 {
		return nil, config.ErrorFor("PROXY_GIT_PRIVATE_NETWORKS", fmt.Errorf("%s: %s", probs[0].Field, probs[0].Description))
	}
	return nets, nil
}

func parseAttestationKey(s string) ([]byte, error) {
	for _, e := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		if k, err := e.DecodeString(s); err == nil {
			if len(k) < attestation.MinKeySize {
				return nil, fmt.Errorf("key is %d bytes, want at least %d", len(k), attestation.MinKeySize)
			}
			return k, nil
		}
	}
	return nil, errors.New("key is not base64")
}

func parseUpstream(s string) (*url.URL, error) {
	if s == "" {
		return nil, nil
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return nil, errors.New("want an absolute http(s) URL without credentials, query or fragment")
	}
	return u, nil
}

// Listeners lets a caller (tests, agentplane dev) pass bound listeners;
// nil fields listen on the configured addresses.
type Listeners struct {
	GRPC, Proxy, Metrics net.Listener
}

// Run serves until ctx ends; nil after a clean drain.
func Run(ctx context.Context, cfg Config) error { return RunWith(ctx, cfg, Listeners{}) }

// RunWith is Run on given listeners.
func RunWith(ctx context.Context, cfg Config, ls Listeners) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	log := cfg.Logger().With("service", "credential")
	credKey, attKey, err := keys(cfg, log)
	if err != nil {
		return err
	}
	rdb, err := cfg.Redis()
	if err != nil {
		return err
	}
	// Serve closes Redis in its shutdown order; this covers every earlier
	// return and is a no-op after Serve.
	defer func() { _ = rdb.Close() }()
	svc, err := grants.New(rdb, credKey, grants.Options{Policy: scope.Policy{
		GrantTTL: cfg.GrantTTL, ReissueBelow: cfg.ReissueBelow, OverlapWindow: cfg.OverlapWindow,
	}, TrustWindow: cfg.TrustWindow})
	if err != nil {
		return err
	}
	// Tracing from OTEL_* (exporting is opt-in); set up last so no early failure leaks it.
	tel, err := telemetry.Setup(ctx, "agentplane-credential")
	if err != nil {
		return fmt.Errorf("telemetry: %w", err)
	}
	defer func() { _ = tel.Shutdown(context.WithoutCancel(ctx)) }() // a no-op after Serve flushed it
	srv, err := grpcserver.New(grpcserver.Options{
		Name: "credential", Logger: log, Redis: rdb, Telemetry: tel, Addr: cfg.GRPCAddr, Listener: ls.GRPC,
		MetricsAddr: cfg.MetricsAddr, MetricsListener: ls.Metrics, InternalToken: cfg.InternalToken,
		DrainDelay: cfg.DrainDelay, ShutdownTimeout: cfg.ShutdownTimeout,
	})
	if err != nil {
		return err
	}
	gm, err := grants.NewMetrics(srv.Registry())
	if err != nil {
		return err
	}
	svc.Observe(gm)
	credentialv1.RegisterCredentialServiceServer(srv, grpcapi.New(svc, log))

	conn, err := grpcclient.Dial(cfg.IngestAddr, cfg.InternalToken)
	if err != nil {
		return fmt.Errorf("ingest client: %w", err)
	}
	defer conn.Close()
	var sink proxy.UsageSink
	var audit proxy.AuditSink
	if cfg.SessionAddr != "" {
		sconn, err := grpcclient.Dial(cfg.SessionAddr, cfg.InternalToken)
		if err != nil {
			return fmt.Errorf("session client: %w", err)
		}
		defer sconn.Close()
		notify := sessionv1.NewSessionNotifyServiceClient(sconn)
		sink = usageReporter{client: notify, log: log}
		ar, err := newAuditReporter(notify, log, srv.Registry())
		if err != nil {
			return err
		}
		srv.Go(ar.run)
		audit = ar
	}
	px, pl, proxyDone, err := startProxy(ctx, cfg, srv, svc, ingestv1.NewIngestServiceClient(conn), sink, audit, attKey, ls.Proxy, log)
	if err != nil {
		return err
	}
	log.Info("credential proxy listening", "addr", pl.Addr().String())
	serveErr := srv.Serve(ctx)
	proxyErr := <-proxyDone
	px.Close()
	return errors.Join(serveErr, proxyErr)
}

// startProxy serves the credential proxy on pl (or ProxyAddr) until the
// server's shutdown begins: it stops taking requests in step with the gRPC
// drain and has finished before Serve closes Redis (background work ends at
// the close_redis step, which waits for it, also when a failed Serve began
// the shutdown and ctx is still live). done receives Serve's result.
func startProxy(ctx context.Context, cfg Config, srv *grpcserver.Server, svc *grants.Service, ingest ingestv1.IngestServiceClient, sink proxy.UsageSink,
	audit proxy.AuditSink, attKey []byte, pl net.Listener, log *slog.Logger) (px *proxy.Proxy, _ net.Listener, done chan error, err error) {
	provider, _ := parseUpstream(cfg.ProviderUpstream)
	backend, _ := parseUpstream(cfg.BackendUpstream)
	providerPolicy, backendPolicy, _ := cfg.policies()
	gitNetworks, _ := cfg.gitNetworks()
	px, err = proxy.New(proxy.Config{
		Resolver: svc, ProviderUpstream: provider, BackendUpstream: backend, Git: svc, GitPrivateNetworks: gitNetworks,
		Provider: providerPolicy, Backend: backendPolicy,
		Ingest: ingest, AttestationKey: attKey, Usage: sink, Audit: audit,
		Registerer: srv.Registry(), Logger: log, ResolveBudget: cfg.ResolveBudget,
	})
	if err != nil {
		return nil, nil, nil, err
	}
	if pl == nil {
		if pl, err = net.Listen("tcp", cfg.ProxyAddr); err != nil {
			return nil, nil, nil, fmt.Errorf("proxy listen: %w", err)
		}
	}
	hs := &http.Server{Handler: px.Handler(), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: proxy.MaxHeadBytes,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	done = make(chan error, 1)
	go func() {
		err := hs.Serve(pl)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		done <- err
	}()
	srv.Go(func(stop context.Context) {
		select {
		case <-ctx.Done():
		case <-stop.Done():
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
		defer cancel()
		if err := hs.Shutdown(sctx); err != nil {
			_ = hs.Close()
		}
	})
	return px, pl, done, nil
}

func keys(cfg Config, log *slog.Logger) (credKey, attKey []byte, err error) {
	if cfg.CredentialKey == "" {
		log.Warn("AGENTPLANE_CREDENTIAL_KEY_FILE (or AGENTPLANE_CREDENTIAL_KEY) is not set: using a random key for this process; stored credentials will not survive a restart (dev only)")
		credKey = sealer.RandomKey()
	} else if credKey, err = sealer.ParseKey(cfg.CredentialKey); err != nil {
		return nil, nil, err
	}
	if cfg.AttestationKey == "" {
		log.Warn("AGENTPLANE_ATTESTATION_KEY_FILE (or AGENTPLANE_ATTESTATION_KEY) is not set: using a random key for this process; upstreams cannot verify attestations (dev only)")
		attKey = sealer.RandomKey()
	} else if attKey, err = parseAttestationKey(cfg.AttestationKey); err != nil {
		return nil, nil, err
	}
	return credKey, attKey, nil
}
