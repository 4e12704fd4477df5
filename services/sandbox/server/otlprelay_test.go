package server

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestOTLPTarget(t *testing.T) {
	for _, tc := range []struct {
		env           map[string]string
		network, addr string
		bad           bool
	}{
		{env: map[string]string{}},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, network: "tcp", addr: "127.0.0.1:4317"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example"}, network: "tcp", addr: "collector.example:443"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "otel:4317"}, network: "tcp", addr: "otel:4317"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "unix:///run/otel.sock"}, network: "unix", addr: "/run/otel.sock"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:2"}, network: "tcp", addr: "b:2"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_SDK_DISABLED": "true"}},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_TRACES_EXPORTER": "none"}},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "collector"}, bad: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://"}, bad: true},
	} {
		network, addr, ok, err := otlpTarget(func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
		if tc.bad {
			require.Error(t, err, "%v", tc.env)
			continue
		}
		require.NoError(t, err, "%v", tc.env)
		require.Equal(t, tc.network != "", ok, "%v", tc.env)
		require.Equal(t, tc.network, network, "%v", tc.env)
		require.Equal(t, tc.addr, addr, "%v", tc.env)
	}
}
