package grpcapi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/pkg/logging"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/scope"
)

// Every handler validates its whole request before it reaches the grants
// service: a server without one (nil) proves that a bad request changes
// nothing, and every bad field is named at once.
func TestBadRequestsNameEveryFieldAndTouchNothing(t *testing.T) {
	s := New(nil, logtest.New(t))
	ctx := context.Background()
	cases := []struct {
		name   string
		call   func() error
		fields []string
	}{
		{"PutBackingCredential", func() error {
			_, err := s.PutBackingCredential(ctx, &credentialv1.PutBackingCredentialRequest{})
			return err
		}, []string{"credential_class", "secret", "session_id"}},
		{"PutBackingCredential too large", func() error {
			_, err := s.PutBackingCredential(ctx, &credentialv1.PutBackingCredentialRequest{SessionId: "s",
				CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: string(make([]byte, 16<<10+1))})
			return err
		}, []string{"secret"}},
		{"DeleteBackingCredential", func() error {
			_, err := s.DeleteBackingCredential(ctx, &credentialv1.DeleteBackingCredentialRequest{})
			return err
		}, []string{"credential_ref"}},
		{"MintHandle", func() error {
			_, err := s.MintHandle(ctx, &credentialv1.MintHandleRequest{Contract: credentialv1.RuntimeContract(99)})
			return err
		}, []string{"contract", "credential_class", "credential_ref", "fence_token", "member.runtime_session_id",
			"member.session_id", "member.user_id", "scope.directory", "scope.sandbox_id"}},
		{"AdoptHandle", func() error {
			_, err := s.AdoptHandle(ctx, &credentialv1.AdoptHandleRequest{Scope: &credentialv1.Scope{SandboxId: "sb", Directory: "relative"}})
			return err
		}, []string{"credential_class", "credential_ref", "fence_token", "member.runtime_session_id",
			"member.session_id", "member.user_id", "scope.directory"}},
		{"RotateHandle", func() error {
			_, err := s.RotateHandle(ctx, &credentialv1.RotateHandleRequest{})
			return err
		}, []string{"fence_token", "scope.directory", "scope.sandbox_id"}},
		{"ResolveHandle", func() error {
			_, err := s.ResolveHandle(ctx, &credentialv1.ResolveHandleRequest{})
			return err
		}, []string{"handle", "sandbox_id"}},
		{"ReleaseMember", func() error {
			_, err := s.ReleaseMember(ctx, &credentialv1.ReleaseMemberRequest{})
			return err
		}, []string{"fence_token", "scope.directory", "scope.sandbox_id", "session_id"}},
		{"RetireScope", func() error {
			_, err := s.RetireScope(ctx, &credentialv1.RetireScopeRequest{})
			return err
		}, []string{"fence_token", "reason", "scope.directory", "scope.sandbox_id"}},
		{"CheckScopeMember", func() error {
			_, err := s.CheckScopeMember(ctx, &credentialv1.CheckScopeMemberRequest{})
			return err
		}, []string{"runtime_session_id", "scope.directory", "scope.sandbox_id"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
			require.Equal(t, ReasonInvalidRequest, apierr.Reason(err))
			var fields []string
			for _, v := range apierr.FieldViolations(err) {
				fields = append(fields, v.GetField())
			}
			slices.Sort(fields)
			require.Equal(t, c.fields, slices.Compact(fields))
		})
	}
}

// toStatus gives every domain error its documented code and reason, wrapped
// or not; anything else is INTERNAL and its text stays in the log.
func TestToStatusMapsEveryDomainError(t *testing.T) {
	var logs logtest.Buffer
	s := New(nil, logging.New(&logs, logging.Text, slog.LevelDebug))
	ctx := context.Background()
	cases := []struct {
		err    error
		code   codes.Code
		reason string
	}{
		{grants.ErrCredentialNotFound, codes.NotFound, ReasonCredentialNotFound},
		{grants.ErrClassMismatch, codes.InvalidArgument, ReasonInvalidRequest},
		{scope.ErrClassMixed, codes.FailedPrecondition, ReasonCredentialClassMixed},
		{scope.ErrHandleConflict, codes.FailedPrecondition, ReasonScopeHandleConflict},
		{scope.ErrNoHandle, codes.NotFound, ReasonScopeHandleNotFound},
		{scope.ErrContractDowngrade, codes.FailedPrecondition, ReasonContractDowngrade},
		{scope.ErrNotWorktree, codes.FailedPrecondition, ReasonNotWorktree},
		{grants.ErrStaleFence, codes.FailedPrecondition, ReasonStaleFenceToken},
		{grants.ErrBusy, codes.Aborted, ReasonScopeBusy},
		{grants.ErrMalformedHandle, codes.Unauthenticated, ReasonHandleInvalid},
		{scope.ErrUnknownHandle, codes.Unauthenticated, ReasonHandleInvalid},
		{scope.ErrNoLiveMember, codes.Unauthenticated, ReasonHandleInvalid},
		{scope.ErrSandboxMismatch, codes.PermissionDenied, ReasonHandleSandboxMismatch},
		{context.Canceled, codes.Canceled, ReasonInternal},
		{context.DeadlineExceeded, codes.DeadlineExceeded, ReasonInternal},
	}
	for _, c := range cases {
		for _, err := range []error{c.err, fmt.Errorf("mint scope sb:/repo: %w", c.err)} {
			got := s.toStatus(ctx, err)
			require.Equal(t, c.code, status.Code(got), "%v", err)
			require.Equal(t, c.reason, apierr.Reason(got), "%v", err)
		}
	}
	require.NoError(t, s.toStatus(ctx, nil))

	internal := s.toStatus(ctx, errors.New("redis: dial tcp 10.0.0.7:6379: connection refused"))
	require.Equal(t, codes.Internal, status.Code(internal))
	require.Equal(t, ReasonInternal, apierr.Reason(internal))
	require.NotContains(t, internal.Error(), "10.0.0.7", "internal error text stays in the log")
	require.Contains(t, logs.String(), "10.0.0.7")
}
