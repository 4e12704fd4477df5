package grpcserver

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// readyGauge exports readiness (health "" SERVING) as a metric, so an alert can tell a
// process that is up but not ready (Redis unreachable, draining) from one that is down.
func (s *Server) readyGauge() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "agentplane_ready",
		Help: "1 while this process's gRPC health (service \"\") is SERVING, else 0.",
	}, func() float64 {
		if s.health == nil {
			return 0
		}
		resp, err := s.health.Check(context.Background(), &healthpb.HealthCheckRequest{Service: ""})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return 0
		}
		return 1
	})
}
