// Package apierr builds gRPC statuses in the one shape every agentplane API uses: a code, a
// human message, and an errdetails.ErrorInfo whose Reason is an UPPER_SNAKE constant listed
// in docs/errors.md, plus BadRequest field violations and RetryInfo where they apply.
//
// Each service keeps a single translator from its domain errors to these statuses; this
// package only builds and reads them, so clients and tests branch on Reason, never on text.
package apierr

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Domain is the ErrorInfo domain of every agentplane error.
const Domain = "agentplane.dev"

// ErrorInfo metadata keys shared by services and their callers.
const (
	// MetaOwner names the replica that owns the entity a call was about,
	// on an error from a replica that does not (SANDBOX_OWNED_ELSEWHERE).
	MetaOwner = "owner"
	// MetaOwnerAddr is that owner's gRPC address, when it advertises one.
	MetaOwnerAddr = "owner_addr"
)

// Option adds detail to a status built by New.
type Option func(*details)

type details struct {
	metadata   map[string]string
	violations []*errdetails.BadRequest_FieldViolation
	retryAfter *time.Duration
}

// Metadata adds a key/value pair to the ErrorInfo metadata. Values must never carry a secret,
// a raw handle or internal error text: clients see them.
func Metadata(key, value string) Option {
	return func(d *details) {
		if d.metadata == nil {
			d.metadata = map[string]string{}
		}
		d.metadata[key] = value
	}
}

// FieldViolation adds one BadRequest field violation; several collect into one BadRequest.
func FieldViolation(field, description string) Option {
	return func(d *details) {
		d.violations = append(d.violations, &errdetails.BadRequest_FieldViolation{Field: field, Description: description})
	}
}

// RetryAfter attaches RetryInfo telling the client when a retry may succeed.
func RetryAfter(delay time.Duration) Option {
	return func(d *details) { d.retryAfter = &delay }
}

// New builds a status with an ErrorInfo{Reason, Domain} and the given details. An OK code
// cannot carry details, so New(codes.OK, ...) returns a plain OK status.
func New(code codes.Code, reason, message string, opts ...Option) *status.Status {
	st := status.New(code, message)
	if code == codes.OK {
		return st
	}
	var d details
	for _, o := range opts {
		o(&d)
	}
	msgs := []protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: Domain, Metadata: d.metadata}}
	if len(d.violations) > 0 {
		msgs = append(msgs, &errdetails.BadRequest{FieldViolations: d.violations})
	}
	if d.retryAfter != nil {
		msgs = append(msgs, &errdetails.RetryInfo{RetryDelay: durationpb.New(*d.retryAfter)})
	}
	withDetails, err := st.WithDetails(msgs...)
	if err != nil {
		// Only possible for OK codes or unmarshalable details, both excluded above.
		return st
	}
	return withDetails
}

// Error is New(...).Err(), for handlers that return errors.
func Error(code codes.Code, reason, message string, opts ...Option) error {
	return New(code, reason, message, opts...).Err()
}

// Info returns the agentplane ErrorInfo carried by err, or nil.
func Info(err error) *errdetails.ErrorInfo {
	for _, d := range statusOf(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == Domain {
			return info
		}
	}
	return nil
}

// Reason returns the ErrorInfo reason of err, or "" when it carries none.
func Reason(err error) string {
	return Info(err).GetReason()
}

// FieldViolations returns the BadRequest field violations carried by err.
func FieldViolations(err error) []*errdetails.BadRequest_FieldViolation {
	var out []*errdetails.BadRequest_FieldViolation
	for _, d := range statusOf(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			out = append(out, br.GetFieldViolations()...)
		}
	}
	return out
}

// RetryDelay returns the RetryInfo delay carried by err and whether there was one.
func RetryDelay(err error) (time.Duration, bool) {
	for _, d := range statusOf(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

// statusOf finds a gRPC status anywhere in err's chain; a nil or non-status error yields an
// empty status (no details).
func statusOf(err error) *status.Status {
	if err == nil {
		return status.New(codes.OK, "")
	}
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		return se.GRPCStatus()
	}
	return status.New(codes.Unknown, err.Error())
}

// ReasonInternal is the reason of errors no translator recognised.
const ReasonInternal = "INTERNAL"

// Unexpected is the last case of every service's error translator: a
// cancelled or expired request keeps its code; anything else is logged with
// its text here and reaches the client as INTERNAL without it.
func Unexpected(ctx context.Context, log *slog.Logger, err error) error {
	switch {
	case errors.Is(err, context.Canceled):
		return Error(codes.Canceled, ReasonInternal, "request cancelled")
	case errors.Is(err, context.DeadlineExceeded):
		return Error(codes.DeadlineExceeded, ReasonInternal, "deadline exceeded")
	}
	log.ErrorContext(ctx, "internal error", "error", err)
	return Error(codes.Internal, ReasonInternal, "internal error")
}

// ReasonStoreUnavailable is the reason of every service's answer while its
// state store (Redis) cannot be reached or cannot serve.
const ReasonStoreUnavailable = "STORE_UNAVAILABLE"

// StoreRetryDelay is the RetryInfo of STORE_UNAVAILABLE: a reconnect or a
// failover usually completes within it.
const StoreRetryDelay = time.Second

// StoreUnavailable is the status of a state-store outage: UNAVAILABLE, so
// clients retry, with RetryInfo.
func StoreUnavailable() error {
	return Error(codes.Unavailable, ReasonStoreUnavailable, "the state store is unavailable; retry", RetryAfter(StoreRetryDelay))
}

// ReasonStoreNotReplicated is the reason of a write the state store applied
// but could not confirm on its replicas in time (storeerr.ErrNotReplicated):
// it was not acknowledged, and retrying it is safe.
const ReasonStoreNotReplicated = "STORE_NOT_REPLICATED"

// StoreNotReplicated is the status of an unconfirmed write: UNAVAILABLE, so
// clients retry, with RetryInfo.
func StoreNotReplicated() error {
	return Error(codes.Unavailable, ReasonStoreNotReplicated, "the write could not be confirmed on the state store's replicas; retry", RetryAfter(StoreRetryDelay))
}
