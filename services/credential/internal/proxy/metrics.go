package proxy

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	denials        *prometheus.CounterVec
	upstreamErrors prometheus.Counter
	resolveRetries prometheus.Counter
	requests       *prometheus.CounterVec
	duration       *prometheus.HistogramVec
	upstream       *prometheus.HistogramVec
	pushRefusals   prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		denials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_denials_total",
			Help: "Proxy requests refused, by reason (headers_too_large, bad_path, unknown_route, method, missing_handle, invalid_handle, unknown_handle, no_live_member, sandbox_mismatch, policy, unavailable, git_not_granted, git_repo_denied, git_endpoint_denied, git_address_denied, method_not_allowed, git_push_ref_denied, git_push_delete_denied, git_push_malformed, git_push_cert_denied, git_push_encoded, request_body; response_echo, response_headers_too_large, response_encoded for upstream responses refused).",
		}, []string{"reason"}),
		upstreamErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_upstream_errors_total",
			Help: "Proxy requests whose upstream could not be reached.",
		}),
		resolveRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_resolve_retries_total",
			Help: "Handle resolutions retried because the credential store was unavailable (a Redis failover).",
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_requests_total",
			Help: "Proxy requests served, by route (provider, backend, ingest, git, unknown) and HTTP status code.",
		}, []string{"route", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "agentplane_credential_proxy_request_duration_seconds",
			Help:    "Seconds from a proxy request's arrival to the end of its response, by route.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9), // 1 ms .. 65 s
		}, []string{"route"}),
		upstream: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "agentplane_credential_proxy_upstream_duration_seconds",
			Help:    "Seconds the upstream took to answer and stream a forwarded request's response, by route (provider, backend, git).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9),
		}, []string{"route"}),
		pushRefusals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_git_push_refused_refs_total",
			Help: "Ref updates the git route refused under the session's push policy (each refused push also counts once in the denials).",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.denials, m.upstreamErrors, m.resolveRetries, m.requests, m.duration, m.upstream, m.pushRefusals} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
