package server

import "os"

// wrapperTraceEnv are the OTEL_* variables a wrapper inherits from the
// service, so it exports its spans where the service does. Headers
// (OTEL_EXPORTER_OTLP_*HEADERS, which may hold collector keys) and client
// keys never go: a sandbox's environment is readable by its runtime.
var wrapperTraceEnv = []string{
	"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER",
	"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
	"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
	"OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
	"OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_RESOURCE_ATTRIBUTES",
	"OTEL_BSP_SCHEDULE_DELAY",
}

// wrapperBaseEnv is the environment every wrapper starts from: PATH and
// the tracing variables above that are set.
func wrapperBaseEnv(lookup func(string) (string, bool)) []string {
	env := []string{"PATH=" + os.Getenv("PATH")}
	for _, k := range wrapperTraceEnv {
		if v, ok := lookup(k); ok {
			env = append(env, k+"="+v)
		}
	}
	return env
}
