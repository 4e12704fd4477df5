package server

import (
	"context"
	"log/slog"
	"time"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/credential/internal/proxy"
)

// usageReportWait bounds a usage report: the proxy holds the end of the
// provider's response for it (so a turn's usage is recorded before the
// runtime can end the turn), and a slow session service must not hold a
// runtime longer than this.
const usageReportWait = 2 * time.Second

// usageReporter sends the proxy's usage reports to the session service
// (SessionNotifyService.NotifyUsage, with the internal token), once each:
// a failed report is logged (never with a handle or secret) and dropped.
type usageReporter struct {
	client sessionv1.SessionNotifyServiceClient
	log    *slog.Logger
}

func (r usageReporter) RecordUsage(ctx context.Context, u proxy.UsageReport) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), usageReportWait)
	defer cancel()
	_, err := r.client.NotifyUsage(ctx, &sessionv1.NotifyUsageRequest{
		SessionId: u.SessionID, SandboxId: u.SandboxID, RuntimeSessionId: u.RuntimeSessionID,
		Usage: &runtimev1.TokenUsage{InputTokens: u.Input, OutputTokens: u.Output,
			CachedTokens: min(u.Cached, u.Input), Requests: 1, Model: u.Model},
	})
	if err != nil {
		r.log.WarnContext(ctx, "usage report to the session service failed", "session_id", u.SessionID, "error", err.Error())
	}
}
