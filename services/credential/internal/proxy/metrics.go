package proxy

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	denials        *prometheus.CounterVec
	upstreamErrors prometheus.Counter
	resolveRetries prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		denials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_denials_total",
			Help: "Proxy requests refused, by reason (headers_too_large, bad_path, unknown_route, method, missing_handle, invalid_handle, unknown_handle, no_live_member, sandbox_mismatch, policy, unavailable, git_not_granted, git_repo_denied, git_endpoint_denied, method_not_allowed; response_echo, response_headers_too_large, response_encoded for upstream responses refused).",
		}, []string{"reason"}),
		upstreamErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_upstream_errors_total",
			Help: "Proxy requests whose upstream could not be reached.",
		}),
		resolveRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_credential_proxy_resolve_retries_total",
			Help: "Handle resolutions retried because the credential store was unavailable (a Redis failover).",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.denials, m.upstreamErrors, m.resolveRetries} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
