package server_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/server"
)

// SandboxService requires the internal token; the wrapper control stream is
// exempt (wrappers authenticate with their launch credential) so routes
// still become ready. Bad input gets INVALID_ARGUMENT with field violations.
func TestInternalTokenAndValidation(t *testing.T) {
	n := startNotify(t)
	svc := startService(t, n.addr, func(c *server.Config) { c.InternalToken = "tok-123" })
	sb := uniqueSandbox(t)

	_, err := svc.client.Prepare(context.Background(), route(sb, "s1", "/repo/t"))
	require.Equal(t, codes.Unauthenticated, status.Code(err))

	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer tok-123")
	_, err = svc.client.Prepare(ctx, route(sb, "s1", "/repo/t"))
	require.NoError(t, err)
	n.wait(t, 0, "ready", "s1")

	bad := route(sb, "s{2}", "repo/../x")
	bad.Route.CredentialClass = sandboxv1.CredentialClass_CREDENTIAL_CLASS_UNSPECIFIED
	_, err = svc.client.Prepare(ctx, bad)
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, "INVALID_ROUTE", apierr.Reason(err))
	var fields []string
	for _, v := range apierr.FieldViolations(err) {
		fields = append(fields, v.GetField())
	}
	require.ElementsMatch(t, []string{"route.session_id", "route.directory", "route.credential_class"}, fields)

	_, err = svc.client.Deliver(ctx, &sandboxv1.DeliverRequest{Tenant: testTenant, SandboxId: sb, SessionId: "nobody",
		Messages: []*sandboxv1.DeliveryMessage{{MessageId: "m1", Content: "x"}}})
	require.Equal(t, codes.NotFound, status.Code(err))
	require.Equal(t, "ROUTE_NOT_FOUND", apierr.Reason(err))

	_, err = svc.client.Prepare(ctx, route(sb, "s1", "/repo/other"))
	require.Equal(t, "ROUTE_DIRECTORY_CONFLICT", apierr.Reason(err))
}
