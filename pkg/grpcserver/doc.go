// Package grpcserver builds the gRPC server every agentplane service runs, and runs it from
// start to an orderly stop. One constructor, New, fixes what would otherwise drift between
// four services: the interceptor order, health, reflection, keepalive, message limits,
// metrics, tracing and the shutdown order.
//
// # Interceptor order (outermost first)
//
//  1. OpenTelemetry stats handler (grpc.StatsHandler, so it runs before every interceptor):
//     it extracts the caller's W3C trace context and opens the server span first, so every
//     later stage (logs, exemplars, a recovered panic) sees the trace and the span covers
//     the whole call, including time spent in the interceptors and the final status.
//  2. Recovery: outermost interceptor so a panic anywhere below it, in a handler or in an
//     interceptor, becomes codes.Internal with a generic message instead of crashing the
//     process. The panic value and stack go to the log only (with the trace id) and are
//     counted in grpc_server_panics_recovered_total; a panicking call unwinds past the
//     logging and metrics stages, which is why recovery logs and counts it itself.
//  3. Logging (slog through go-grpc-middleware): before auth and validation so rejected
//     calls are logged with their code; each line carries trace_id/span_id from the span
//     opened in 1. Health and reflection are not logged (probes would drown the log).
//  4. Prometheus metrics (grpc_server_*): before auth so rejected calls are counted by code
//     too; after recovery so a handler panic cannot skip the metric's bookkeeping mid-call.
//  5. Internal auth: a bearer token in `authorization: Bearer <token>` metadata, compared
//     in constant time. Health is exempt (probes carry no token); reflection is not, since
//     it lists the internal services (grpcurl -H 'authorization: Bearer <token>').
//     Options.AuthExempt exempts methods that authenticate callers themselves, e.g. the
//     wrapper control stream and its launch credential. An empty token disables the check
//     (dev only).
//  6. Validation: a request that did not decode is refused with INVALID_ARGUMENT
//     MALFORMED_REQUEST, last, so unauthenticated callers learn nothing about request
//     shapes. Field validation is each handler's (with field violations, through the
//     service's one error translator): no request message validates itself.
//
// # Decoding
//
// The server's codec (grpc.ForceServerCodecV2) is protobuf, except that a message that
// fails to decode (truncated, invalid UTF-8 in a string field) is reset and marked instead
// of failing: grpc-go would answer INTERNAL before any interceptor ran, uncounted in
// grpc_server_handled_total and without ErrorInfo. Stage 6 turns the mark into the status,
// so such calls are logged and counted like any other. A unary request is decoded before
// the interceptors; a small stage right after the metrics forgets its mark when auth
// refused the call first.
//
// # Health
//
// grpc.health.v1 is always registered. Service "" (readiness) is SERVING only while Redis
// answers PING: a checker pings every Options.HealthInterval and flips the status both ways.
// Every service registered on the server mirrors "", so a client can check its own service
// name. Service "liveness" is SERVING from start until shutdown begins.
//
// # Shutdown order (Serve, after its context ends)
//
//  1. health NOT_SERVING for every service, so load balancers stop sending new calls;
//  2. drain delay (Options.DrainDelay), long enough for them to notice;
//  3. GracefulStop raced against Options.ShutdownTimeout, then a hard Stop, so long-lived
//     streams (watchers, wrapper control streams) cannot hold the process forever;
//  4. close Redis, only after no handler can still use it: the background work started with
//     Server.Go is stopped and waited for first;
//  5. flush telemetry, after the last span ended;
//  6. stop the metrics HTTP server last, so scrapes see the whole shutdown.
//
// Options.OnShutdownStep observes each step as it begins (tests assert the order with it).
package grpcserver
