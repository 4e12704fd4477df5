// Package grpcclient dials the internal gRPC peers of a service the same way
// everywhere: plaintext or the caller's transport credentials, the internal
// bearer token on every call, and W3C trace context propagation so traces
// cross service boundaries.
package grpcclient

import (
	"context"
	"fmt"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
)

// Dial returns a client connection to addr, any form ParseTarget accepts: a
// list or a dns:/// name balances calls round robin over its backends. token,
// when not empty, is sent as `authorization: Bearer <token>`. Extra options
// come last so callers can replace the transport credentials (mTLS in
// production).
func Dial(addr, token string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	t, err := ParseTarget(addr)
	if err != nil {
		return nil, fmt.Errorf("grpcclient: address %q: %w", addr, err)
	}
	base := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(
			otelgrpc.WithPropagators(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})),
		)),
	}
	if token != "" {
		base = append(base, grpc.WithPerRPCCredentials(bearer(token)))
	}
	target := t.Raw
	if t.RoundRobin() {
		base = append(base, grpc.WithDefaultServiceConfig(roundRobin))
	}
	if len(t.Addrs) > 1 {
		// A list: a resolver local to this connection hands gRPC the
		// addresses; rebuilt (on leaving idle) it hands them again.
		r := manual.NewBuilderWithScheme(listScheme)
		state := resolver.State{}
		for _, a := range t.Addrs {
			state.Addresses = append(state.Addresses, resolver.Address{Addr: a})
		}
		r.InitialState(state)
		base = append(base, grpc.WithResolvers(r))
		target = listScheme + ":///" + strings.Join(t.Addrs, ",")
	}
	conn, err := grpc.NewClient(target, append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("grpcclient: dial %s: %w", addr, err)
	}
	return conn, nil
}

const (
	listScheme = "agentplane-list"
	roundRobin = `{"loadBalancingConfig":[{"round_robin":{}}]}`
)

// bearer is the internal token as per-RPC credentials.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity is false: inside a cluster the token may travel
// over plaintext; production deployments add mTLS through Dial's options.
func (bearer) RequireTransportSecurity() bool { return false }

// Conns dials a service's peers with one token and closes them together at
// shutdown.
type Conns struct {
	token string
	conns []*grpc.ClientConn
}

// NewConns returns an empty set whose connections carry token.
func NewConns(token string) *Conns { return &Conns{token: token} }

// Dial dials addr like Dial and remembers the connection for Close.
func (c *Conns) Dial(addr string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	conn, err := Dial(addr, c.token, opts...)
	if err != nil {
		return nil, err
	}
	c.conns = append(c.conns, conn)
	return conn, nil
}

// Close closes every connection dialled through c.
func (c *Conns) Close() {
	for _, conn := range c.conns {
		_ = conn.Close()
	}
	c.conns = nil
}
