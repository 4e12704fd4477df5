package grpcserver

import (
	"context"
	"strings"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// mirroredServices are the registered services whose health follows readiness (""):
// everything but health and reflection themselves.
func (s *Server) mirroredServices() []string {
	var names []string
	for name := range s.grpc.GetServiceInfo() {
		if name == healthpb.Health_ServiceDesc.ServiceName || isReflection(name) {
			continue
		}
		names = append(names, name)
	}
	// The overall name last: a client that sees "" SERVING finds every service SERVING too.
	return append(names, "")
}

// isReflection matches the v1 and v1alpha reflection services.
func isReflection(service string) bool {
	return strings.HasPrefix(service, "grpc.reflection.")
}

// checkRedis keeps readiness equal to "Redis answers PING": it pings at once, then every
// HealthInterval, and sets every name in services on each change, until ctx ends.
func (s *Server) checkRedis(ctx context.Context, services []string) {
	ticker := time.NewTicker(s.opts.HealthInterval)
	defer ticker.Stop()
	last := healthpb.HealthCheckResponse_UNKNOWN
	for {
		pingCtx, cancel := context.WithTimeout(ctx, s.opts.HealthTimeout)
		err := s.opts.Redis.Ping(pingCtx).Err()
		cancel()
		if ctx.Err() != nil {
			return // shutting down: a failed PING now says nothing about Redis
		}
		st := healthpb.HealthCheckResponse_SERVING
		if err != nil {
			st = healthpb.HealthCheckResponse_NOT_SERVING
		}
		if st != last {
			if err != nil {
				s.log.Warn("not ready: redis does not answer", "error", err)
			} else {
				s.log.Info("ready: redis answers")
			}
			for _, name := range services {
				s.health.SetServingStatus(name, st)
			}
			last = st
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
	}
}
