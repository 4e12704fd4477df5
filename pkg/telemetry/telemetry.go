// Package telemetry configures OpenTelemetry tracing from the standard OTEL_* environment
// variables and installs W3C trace context propagation, so one trace follows a request
// client → session → sandbox → wrapper → proxy → ingest.
//
// Exporting is opt-in: with no OTLP endpoint set (the dev default) no exporter runs and
// nothing needs configuring, yet incoming traceparent headers are still propagated, so the
// trace ids in logs still match the caller's trace. Variables read:
//
//   - OTEL_SDK_DISABLED=true: no exporter.
//   - OTEL_TRACES_EXPORTER: "otlp" or "none"; when unset, "otlp" if an OTLP endpoint is set
//     (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), else "none".
//   - OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL: only "grpc" is built in; anything else fails.
//   - the OTLP exporter reads its own OTEL_EXPORTER_OTLP_* (endpoint, headers, TLS, timeout),
//     the SDK reads OTEL_TRACES_SAMPLER[_ARG], and the resource reads OTEL_SERVICE_NAME and
//     OTEL_RESOURCE_ATTRIBUTES (both override the service name given to Setup).
package telemetry

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Provider is the process's tracing setup. Its Shutdown flushes buffered spans.
type Provider struct {
	sdk *sdktrace.TracerProvider // nil when exporting is off
}

// Setup reads the OTEL_* environment, installs the global tracer provider and the W3C
// propagator (tracecontext + baggage), and returns the provider to flush at shutdown.
// Call it once per process; serviceName is the default for OTEL_SERVICE_NAME.
func Setup(ctx context.Context, serviceName string, opts ...Option) (*Provider, error) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))

	exporter, err := exporterFromEnv()
	if err != nil {
		return nil, err
	}
	if exporter == "none" {
		// The global provider stays the API's no-op one: spans are not recorded, but the
		// propagated parent span context stays in ctx, so log lines keep the caller's ids.
		return &Provider{}, nil
	}

	var o options
	for _, opt := range opts {
		opt(&o)
	}
	exp, err := otlptracegrpc.New(ctx, o.exporter...)
	if err != nil {
		return nil, fmt.Errorf("telemetry: OTLP trace exporter: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", serviceName)),
		resource.WithFromEnv(), // after the default so OTEL_SERVICE_NAME wins
		resource.WithTelemetrySDK(),
	)
	if err != nil {
		return nil, fmt.Errorf("telemetry: resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	return &Provider{sdk: tp}, nil
}

// Exporting reports whether spans are exported.
func (p *Provider) Exporting() bool { return p != nil && p.sdk != nil }

// TracerProvider returns the provider to instrument with (the global one).
func (p *Provider) TracerProvider() trace.TracerProvider {
	if p.Exporting() {
		return p.sdk
	}
	return otel.GetTracerProvider()
}

// Shutdown flushes buffered spans and stops the exporter; bounded by ctx. Safe on nil.
func (p *Provider) Shutdown(ctx context.Context) error {
	if !p.Exporting() {
		return nil
	}
	return p.sdk.Shutdown(ctx)
}

func exporterFromEnv() (string, error) {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return "none", nil
	}
	exporter := strings.ToLower(strings.TrimSpace(os.Getenv("OTEL_TRACES_EXPORTER")))
	if exporter == "" {
		exporter = "none"
		if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "" {
			exporter = "otlp"
		}
	}
	switch exporter {
	case "none":
		return exporter, nil
	case "otlp":
	default:
		return "", fmt.Errorf("telemetry: OTEL_TRACES_EXPORTER=%q is not supported (want otlp or none)", exporter)
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if v := os.Getenv(name); v != "" {
			if v != "grpc" {
				return "", fmt.Errorf("telemetry: %s=%q is not supported (only grpc is built in)", name, v)
			}
			break // the traces-specific variable wins over the general one
		}
	}
	return exporter, nil
}
