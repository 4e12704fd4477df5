package server

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/credential/internal/proxy"
)

// Bounds of the audit reporter: the queue a request's report waits in
// (a full queue drops the report, counted), the batch one NotifyAudit
// carries, how long a report waits for its batch to fill, and how long a
// send may take (the queue keeps filling meanwhile, and drops when full).
const (
	auditQueueSize  = 4096
	auditBatchSize  = 256
	auditFlushEvery = 200 * time.Millisecond
	auditSendWait   = 5 * time.Second
)

// auditReporter sends the proxy's request reports to the session service
// (SessionNotifyService.NotifyAudit, with the internal token) in batches
// from a bounded queue. The proxy never waits for it: a report that finds
// the queue full, or whose batch the session service did not take, is
// dropped and counted (agentplane_credential_audit_reports_dropped_total).
type auditReporter struct {
	client  sessionv1.SessionNotifyServiceClient
	log     *slog.Logger
	queue   chan proxy.AuditReport
	sent    prometheus.Counter
	dropped *prometheus.CounterVec
}

func newAuditReporter(client sessionv1.SessionNotifyServiceClient, log *slog.Logger, reg prometheus.Registerer) (*auditReporter, error) {
	r := &auditReporter{client: client, log: log, queue: make(chan proxy.AuditReport, auditQueueSize),
		sent: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_credential_audit_reports_sent_total",
			Help: "Audit reports of proxied requests the session service took (SessionNotifyService.NotifyAudit).",
		}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_credential_audit_reports_dropped_total",
			Help: "Audit reports of proxied requests dropped, by reason (queue_full: the session service is slower than the proxy or down; send_failed: it refused or did not answer a batch).",
		}, []string{"reason"}),
	}
	r.dropped.WithLabelValues("queue_full")
	r.dropped.WithLabelValues("send_failed")
	for _, c := range []prometheus.Collector{r.sent, r.dropped} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// RecordRequest queues a report; it never blocks.
func (r *auditReporter) RecordRequest(rep proxy.AuditReport) {
	select {
	case r.queue <- rep:
	default:
		r.dropped.WithLabelValues("queue_full").Inc()
	}
}

// run sends batches until ctx ends, then what is queued, each batch
// bounded by auditSendWait.
func (r *auditReporter) run(ctx context.Context) {
	tick := time.NewTicker(auditFlushEvery)
	defer tick.Stop()
	batch := make([]proxy.AuditReport, 0, auditBatchSize)
	flush := func() {
		if len(batch) > 0 {
			r.send(ctx, batch)
			batch = batch[:0]
		}
	}
	for {
		select {
		case rep := <-r.queue:
			batch = append(batch, rep)
			if len(batch) == auditBatchSize {
				flush()
			}
		case <-tick.C:
			flush()
		case <-ctx.Done():
			for {
				select {
				case rep := <-r.queue:
					batch = append(batch, rep)
					if len(batch) == auditBatchSize {
						flush()
					}
				default:
					flush()
					return
				}
			}
		}
	}
}

func (r *auditReporter) send(ctx context.Context, batch []proxy.AuditReport) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), auditSendWait)
	defer cancel()
	req := &sessionv1.NotifyAuditRequest{Reports: make([]*sessionv1.ProxyRequestReport, 0, len(batch))}
	for _, b := range batch {
		req.Reports = append(req.Reports, &sessionv1.ProxyRequestReport{
			SessionId: b.SessionID, SandboxId: b.SandboxID, RuntimeSessionId: b.RuntimeSessionID, RuntimeKey: b.RuntimeKey,
			StartTime: timestamppb.New(b.Start),
			Request: &sessionv1.AuditProxyRequest{Route: string(b.Route), Method: b.Method, PathTemplate: b.PathTemplate,
				Status: int32(b.Status), BytesIn: b.BytesIn, BytesOut: b.BytesOut, Duration: durationpb.New(b.Duration)}, //nolint:gosec // an HTTP status
		})
	}
	if _, err := r.client.NotifyAudit(ctx, req); err != nil {
		r.dropped.WithLabelValues("send_failed").Add(float64(len(batch)))
		r.log.WarnContext(ctx, "audit reports to the session service failed", "reports", len(batch), "error", err.Error())
		return
	}
	r.sent.Add(float64(len(batch)))
}
