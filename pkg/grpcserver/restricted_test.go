package grpcserver_test

import (
	"net"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/grpcserver"
)

// A restricted listener serves what its allow admits and refuses the rest
// before auth, with the internal token or without one, and with or without
// a token configured; the main listener is unchanged.
func TestServeRestricted(t *testing.T) {
	for _, token := range []string{"", "s3cret-token"} {
		t.Run("token="+map[bool]string{true: "on", false: "off"}[token != ""], func(t *testing.T) {
			h := start(t, func(o *grpcserver.Options) { o.InternalToken = token })
			sock := filepath.Join(t.TempDir(), "control")
			ln, err := net.Listen("unix", sock)
			require.NoError(t, err)
			allow := func(m string) bool { return m == "/test.Echo/Exempt" || m == "/grpc.health.v1.Health/Check" }
			go func() { _ = h.srv.ServeRestricted(ln, allow) }()
			conn, err := grpc.NewClient("unix:"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
			require.NoError(t, err)
			t.Cleanup(func() { _ = conn.Close() })
			ctx := t.Context()
			if token != "" {
				ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
			}
			h.waitStatus(t, "", healthpb.HealthCheckResponse_SERVING)

			out := &wrapperspb.StringValue{}
			err = conn.Invoke(ctx, "/test.Echo/Echo", wrapperspb.String("x"), out)
			require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
			require.Equal(t, grpcserver.ReasonMethodNotServed, apierr.Reason(err))
			rc, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
			require.NoError(t, err)
			_, err = rc.Recv()
			require.Equal(t, codes.PermissionDenied, status.Code(err), "reflection: %v", err)
			w, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{})
			require.NoError(t, err)
			_, err = w.Recv()
			require.Equal(t, codes.PermissionDenied, status.Code(err), "a method allow does not name")

			resp, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{})
			require.NoError(t, err)
			require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
			require.NoError(t, conn.Invoke(ctx, "/test.Echo/Exempt", wrapperspb.String("y"), out))
			require.Equal(t, "y", out.GetValue())

			// The main listener serves everything, as before.
			got, err := h.call(ctx, "Echo", "z")
			require.NoError(t, err)
			require.Equal(t, "z", got)
		})
	}
}
