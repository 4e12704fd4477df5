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

	"agentplane.dev/pkg/apierr"
)

// Reasons (ErrorInfo.Reason) produced by the server itself; listed in docs/errors.md.
const (
	ReasonInternal           = "INTERNAL"
	ReasonMissingCredentials = "MISSING_CREDENTIALS"
	ReasonInvalidCredentials = "INVALID_CREDENTIALS"
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

// validateUnary refuses a request that did not decode (MALFORMED_REQUEST). Field
// validation is the handlers' (each service's grpcapi, with field violations).
func (s *Server) validateUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := s.codec.take(req); err != nil {
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

// validatingStream refuses each message a client sends on a stream that did not decode, as
// it is received: a stream message is decoded inside the interceptors, after auth.
type validatingStream struct {
	grpc.ServerStream
	codec *decodeCodec
}

func (s validatingStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	return s.codec.take(m)
}
