// Package apierrtest holds the assertion every service's tests make about an
// error answer: its gRPC code and its ErrorInfo reason (docs/errors.md).
package apierrtest

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
)

// RequireStatus fails t unless err is a gRPC status with code and an
// ErrorInfo naming reason ("" when the answer carries no ErrorInfo).
func RequireStatus(t testing.TB, err error, code codes.Code, reason string) {
	t.Helper()
	require.Error(t, err)
	require.Equal(t, code, status.Code(err), "status: %v", err)
	require.Equal(t, reason, apierr.Reason(err), "status: %v", err)
}
