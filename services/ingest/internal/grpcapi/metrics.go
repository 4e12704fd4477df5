package grpcapi

import (
	"context"
	"errors"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
)

// Metrics are the ingest service's Prometheus metrics. Labels are
// ErrorInfo reasons only: a bounded set, never a runtime session id.
type Metrics struct {
	items    prometheus.Counter
	bytes    prometheus.Counter
	batches  prometheus.Counter
	rejected *prometheus.CounterVec
	tails    prometheus.Gauge
}

// NewMetrics builds the metrics and registers them on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		items: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_ingest_items_total",
			Help: "History items applied (new or newer versions; ignored duplicates not counted).",
		}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_ingest_bytes_total",
			Help: "Bytes of ingest batches received (protobuf size of each batch), stored or not.",
		}),
		batches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_ingest_batches_total",
			Help: "Ingest batches stored.",
		}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_ingest_batches_rejected_total",
			Help: "Ingest calls refused, by ErrorInfo reason (INVALID_REQUEST, LIMIT_EXCEEDED, SCOPE_MISMATCH, SCOPE_CHECK_UNAVAILABLE, RUNTIME_SESSION_NOT_FOUND, ..., OTHER).",
		}, []string{"reason"}),
		tails: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "agentplane_ingest_tails_open",
			Help: "Tail streams open on this replica.",
		}),
	}
	for _, c := range []prometheus.Collector{m.items, m.bytes, m.batches, m.rejected, m.tails} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Observe makes s count into m. Call it before serving.
func (s *Service) Observe(m *Metrics) { s.obs = m }

// reasonOf is a status error's ErrorInfo reason; OTHER for a status without
// one (a transport error, a cancelled caller).
func reasonOf(err error) string {
	if st, ok := status.FromError(err); ok {
		for _, d := range st.Details() {
			if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() != "" {
				return info.GetReason()
			}
		}
	}
	return "OTHER"
}

// Ingest stores one batch atomically (see ingest), counted.
func (s *Service) Ingest(ctx context.Context, req *ingestv1.IngestRequest) (*ingestv1.IngestResponse, error) {
	resp, err := s.ingest(ctx, req)
	if m := s.obs; m != nil {
		m.bytes.Add(float64(proto.Size(req)))
		if err != nil {
			m.rejected.WithLabelValues(reasonOf(err)).Inc()
		} else {
			m.batches.Inc()
			m.items.Add(float64(resp.GetApplied()))
		}
	}
	return resp, err
}

// IngestStream stores each batch of a client stream (see ingestStream), counted.
func (s *Service) IngestStream(stream grpc.ClientStreamingServer[ingestv1.IngestStreamRequest, ingestv1.IngestStreamResponse]) error {
	if s.obs == nil {
		return s.ingestStream(stream)
	}
	cs := &countedStream{ClientStreamingServer: stream, m: s.obs}
	err := s.ingestStream(cs)
	if err != nil && !errors.Is(err, context.Canceled) {
		s.obs.rejected.WithLabelValues(reasonOf(err)).Inc()
	}
	return err
}

type countedStream struct {
	grpc.ClientStreamingServer[ingestv1.IngestStreamRequest, ingestv1.IngestStreamResponse]
	m *Metrics
}

func (c *countedStream) Recv() (*ingestv1.IngestStreamRequest, error) {
	req, err := c.ClientStreamingServer.Recv()
	if err == nil {
		c.m.bytes.Add(float64(proto.Size(req)))
	}
	return req, err
}

func (c *countedStream) SendAndClose(resp *ingestv1.IngestStreamResponse) error {
	c.m.items.Add(float64(resp.GetApplied()))
	c.m.batches.Add(float64(resp.GetBatches()))
	return c.ClientStreamingServer.SendAndClose(resp)
}

// Tail streams a runtime session's history (see tail), counted as open.
func (s *Service) Tail(req *ingestv1.TailRequest, stream grpc.ServerStreamingServer[ingestv1.TailResponse]) error {
	if s.obs != nil {
		s.obs.tails.Inc()
		defer s.obs.tails.Dec()
	}
	return s.tail(req, stream)
}
