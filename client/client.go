// Package client is the Go client of agentplane's public SessionService for
// backend services. Over the generated stubs it adds what every caller would
// otherwise write itself:
//
//   - Dial with the internal token, TLS, W3C trace propagation and keepalive;
//   - bounded retries of the retryable errors of docs/errors.md, honouring
//     the server's RetryInfo and never waiting past the context's deadline;
//   - ids made on the client (session and message ids), so CreateSession and
//     SendMessage are safe to retry;
//   - DeleteSession that waits through DELETION_PENDING_CLEANUP;
//   - Watch, an iterator over a session's events that resumes from its last
//     cursor when the stream breaks, without losing or repeating an event.
//
// Requests and results are the generated types of agentplane.dev/pkg/gen, so
// a field added to the API is usable at once.
package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// DefaultAddr is the session service of `agentplane dev`.
const DefaultAddr = "127.0.0.1:7401"

// ConnectBackoffMax is the longest wait between two connect attempts of a
// failing connection: shorter than the retries of one call with the default
// policy, so a call made while the service restarts gets through once it
// is back.
const ConnectBackoffMax = time.Second

// Client calls one SessionService. It is safe for concurrent use.
type Client struct {
	rpc   sessionv1.SessionServiceClient
	conn  *grpc.ClientConn // nil when built by New
	retry RetryPolicy
	hook  func(Retry)
	clock clock
}

type settings struct {
	token     string
	creds     credentials.TransportCredentials
	keepalive keepalive.ClientParameters
	retry     RetryPolicy
	hook      func(Retry)
	dialOpts  []grpc.DialOption
}

// Option configures Dial or New.
type Option func(*settings)

// WithToken sends `authorization: Bearer <token>` on every call (the
// internal token of a deployment that requires one).
func WithToken(token string) Option { return func(s *settings) { s.token = token } }

// WithTLS dials with TLS; a nil config uses the system roots.
func WithTLS(cfg *tls.Config) Option {
	return func(s *settings) {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		s.creds = credentials.NewTLS(cfg)
	}
}

// WithTransportCredentials sets the transport credentials (mTLS, ALTS...).
// The default is plaintext, as in `agentplane dev`.
func WithTransportCredentials(c credentials.TransportCredentials) Option {
	return func(s *settings) { s.creds = c }
}

// WithKeepalive replaces the default keepalive (a ping after 30 s without
// activity, the connection closed when it is not answered within 10 s; the
// services accept pings every 10 s).
func WithKeepalive(p keepalive.ClientParameters) Option {
	return func(s *settings) { s.keepalive = p }
}

// WithRetryPolicy replaces DefaultRetryPolicy.
func WithRetryPolicy(p RetryPolicy) Option { return func(s *settings) { s.retry = p } }

// WithRetryHook calls fn before each wait for a retry (unary retries,
// DeleteSession's waits through a pending cleanup, Watch's reconnects), for
// logging or progress.
func WithRetryHook(fn func(Retry)) Option { return func(s *settings) { s.hook = fn } }

// WithDialOptions adds gRPC dial options after the client's own.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(s *settings) { s.dialOpts = append(s.dialOpts, opts...) }
}

func newSettings(opts []Option) settings {
	s := settings{
		creds:     insecure.NewCredentials(),
		keepalive: keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second},
		retry:     DefaultRetryPolicy,
	}
	for _, o := range opts {
		o(&s)
	}
	return s
}

// Dial returns a client of the SessionService at target (host:port or any
// gRPC target, e.g. dns:///session.agentplane:7401). It does not connect
// yet: the first call does, and an unreachable target fails that call after
// its retries.
func Dial(target string, opts ...Option) (*Client, error) {
	s := newSettings(opts)
	if err := s.retry.validate(); err != nil {
		return nil, err
	}
	dial := []grpc.DialOption{
		grpc.WithTransportCredentials(s.creds),
		grpc.WithKeepaliveParams(s.keepalive),
		// While a connection fails, calls fail at once until the next
		// connect attempt; gRPC's default backoff (up to 2 minutes) would
		// outlast every retry of a call after a restart of the service.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: ConnectBackoffMax},
			MinConnectTimeout: 20 * time.Second,
		}),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(
			otelgrpc.WithPropagators(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
		)),
	}
	if s.token != "" {
		dial = append(dial, grpc.WithPerRPCCredentials(bearer(s.token)))
	}
	conn, err := grpc.NewClient(target, append(dial, s.dialOpts...)...)
	if err != nil {
		return nil, fmt.Errorf("client: dial %s: %w", target, err)
	}
	return &Client{rpc: sessionv1.NewSessionServiceClient(conn), conn: conn, retry: s.retry, hook: s.hook, clock: wallClock}, nil
}

// New returns a client over a connection the caller dialled (and closes).
// Only the retry options apply.
func New(conn grpc.ClientConnInterface, opts ...Option) (*Client, error) {
	s := newSettings(opts)
	if err := s.retry.validate(); err != nil {
		return nil, err
	}
	return &Client{rpc: sessionv1.NewSessionServiceClient(conn), retry: s.retry, hook: s.hook, clock: wallClock}, nil
}

// Close closes the connection Dial opened.
func (c *Client) Close() error {
	if c.conn == nil {
		return nil
	}
	return c.conn.Close()
}

// Raw returns the generated stub, for calls without the client's retries.
func (c *Client) Raw() sessionv1.SessionServiceClient { return c.rpc }

// bearer is the token as per-RPC credentials.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity is false: inside a cluster (and in dev) the token
// may travel over plaintext, as between the services themselves.
func (bearer) RequireTransportSecurity() bool { return false }

var errBadPolicy = errors.New("client: bad retry policy")
