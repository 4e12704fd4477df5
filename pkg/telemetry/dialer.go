package telemetry

import (
	"context"
	"net"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/resolver"
)

// Option changes how Setup exports.
type Option func(*options)

type options struct{ exporter []otlptracegrpc.Option }

// WithDialer carries the OTLP export over the connections dial makes instead
// of dialing the endpoint: behind the sandbox boundary the wrapper has no
// network route, and dial reaches the sandbox service's relay, which dials
// the endpoint outside. The endpoint stays the configured one for TLS (its
// server name) and :authority, but it is not resolved here, where there is
// no DNS: the relay resolves it.
func WithDialer(dial func(ctx context.Context, addr string) (net.Conn, error)) Option {
	return func(o *options) {
		o.exporter = append(o.exporter, otlptracegrpc.WithDialOption(
			grpc.WithContextDialer(dial),
			grpc.WithResolvers(unresolved{resolver.Get("passthrough")}),
		))
	}
}

// unresolved takes the place of the default "dns" resolver for one client
// and hands the target to the dialer as written (what passthrough does).
type unresolved struct{ resolver.Builder }

func (unresolved) Scheme() string { return "dns" }
