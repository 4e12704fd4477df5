package grpcserver

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"runtime/debug"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
)

// Reasons (ErrorInfo.Reason) produced by the server itself; listed in docs/errors.md.
const (
	ReasonInternal           = "INTERNAL"
	ReasonMissingCredentials = "MISSING_CREDENTIALS"
	ReasonInvalidCredentials = "INVALID_CREDENTIALS"
	ReasonInvalidRequest     = "INVALID_REQUEST"
)

// recovered logs a handler panic with its stack and returns the generic error the client
// gets: panic text can hold internal state and must never reach a client.
func (s *Server) recovered(ctx context.Context, p any) error {
	method, _ := grpc.Method(ctx)
	s.log.ErrorContext(ctx, "panic in gRPC handler", "grpc.method", method, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
	return apierr.Error(codes.Internal, ReasonInternal, "internal error")
}

// bearerAuth checks `authorization: Bearer <token>`. Both sides are hashed first so the
// constant-time comparison does not leak the token's length either.
func bearerAuth(token string) auth.AuthFunc {
	want := sha256.Sum256([]byte(token))
	return func(ctx context.Context) (context.Context, error) {
		got, err := auth.AuthFromMD(ctx, "bearer")
		if err != nil {
			return nil, apierr.Error(codes.Unauthenticated, ReasonMissingCredentials, "missing bearer token")
		}
		sum := sha256.Sum256([]byte(got))
		if subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
			return nil, apierr.Error(codes.Unauthenticated, ReasonInvalidCredentials, "invalid bearer token")
		}
		return ctx, nil
	}
}

// Validator is implemented by request messages that can check themselves. A status error
// (e.g. built with apierr and field violations) reaches the client as is; any other error
// becomes INVALID_ARGUMENT with reason INVALID_REQUEST and the error's text, which is
// therefore written for clients.
type Validator interface {
	Validate() error
}

func validate(msg any) error {
	v, ok := msg.(Validator)
	if !ok {
		return nil
	}
	err := v.Validate()
	if err == nil {
		return nil
	}
	if _, isStatus := status.FromError(err); isStatus {
		return err
	}
	return apierr.Error(codes.InvalidArgument, ReasonInvalidRequest, err.Error())
}

// validateUnary refuses a request that did not decode (MALFORMED_REQUEST) or does not
// validate.
func (s *Server) validateUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := s.codec.take(req); err != nil {
		return nil, err
	}
	if err := validate(req); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

// forgetMalformed drops the decode mark of a unary request whose call ended before the
// validation stage (auth refused it): a unary request is decoded before any interceptor.
func (s *Server) forgetMalformed(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	defer func() { _ = s.codec.take(req) }()
	return handler(ctx, req)
}

func (s *Server) validateStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return handler(srv, validatingStream{ss, s.codec})
}

// validatingStream checks each message a client sends on a stream as it is received: a
// stream message is decoded inside the interceptors, after auth.
type validatingStream struct {
	grpc.ServerStream
	codec *decodeCodec
}

func (s validatingStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if err := s.codec.take(m); err != nil {
		return err
	}
	return validate(m)
}
