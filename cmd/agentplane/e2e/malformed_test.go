package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"agentplane.dev/pkg/apierr"
	_ "agentplane.dev/pkg/gen/agentplane/credential/v1" // descriptors of every service the suite serves
	_ "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	_ "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	_ "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/grpcserver"
)

// rawCodec sends message bytes as they are: what no generated client sends.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}
func (rawCodec) Name() string { return "proto" }

// invalidUTF8 encodes a message of type md whose first string field (at
// the top or nested in a message field) holds invalid UTF-8; nil when md
// has no string field within three levels.
func invalidUTF8(md protoreflect.MessageDescriptor, depth int) []byte {
	fields := md.Fields()
	for i := range fields.Len() {
		f := fields.Get(i)
		if f.Kind() == protoreflect.StringKind && !f.IsMap() {
			return protowire.AppendBytes(protowire.AppendTag(nil, f.Number(), protowire.BytesType), []byte{0xff, 0xfe, 'x'})
		}
	}
	if depth == 0 {
		return nil
	}
	for i := range fields.Len() {
		f := fields.Get(i)
		if f.Kind() == protoreflect.MessageKind && !f.IsMap() {
			if inner := invalidUTF8(f.Message(), depth-1); inner != nil {
				return protowire.AppendBytes(protowire.AppendTag(nil, f.Number(), protowire.BytesType), inner)
			}
		}
	}
	return nil
}

// truncated is a length-delimited field 1 whose length runs past the end.
var truncated = []byte{0x0a, 0x05, 'a'}

// startMetricsSuite runs the four services with the internal token, each
// with its metrics endpoint; it returns gRPC and metrics addresses by
// service.
func startMetricsSuite(t *testing.T) (grpcAddr, metricsURL map[string]string) {
	st := newStack(t, stackOptions{logLevel: "error", logFormat: "text", metrics: true})
	st.runInProcess(nil)
	grpcAddr = map[string]string{}
	for _, svc := range allServices {
		grpcAddr[svc] = st.addr[svc]
	}
	return grpcAddr, st.metricsURL
}

// listed returns the services reflection lists on conn (with the token).
func listed(t *testing.T, ctx context.Context, conn *grpc.ClientConn) []string {
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	require.NoError(t, err)
	require.NoError(t, stream.Send(&reflectionpb.ServerReflectionRequest{
		MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{ListServices: "*"},
	}))
	resp, err := stream.Recv()
	require.NoError(t, err)
	require.NoError(t, stream.CloseSend())
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	return names
}

// call sends body as the one request of method and returns the status the
// server ends the call with.
func call(ctx context.Context, conn *grpc.ClientConn, m protoreflect.MethodDescriptor, body []byte) error {
	full := fmt.Sprintf("/%s/%s", m.Parent().FullName(), m.Name())
	if !m.IsStreamingClient() && !m.IsStreamingServer() {
		var out []byte
		return conn.Invoke(ctx, full, &body, &out, grpc.ForceCodecV2(rawCodec{}))
	}
	st, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: m.IsStreamingClient(), ServerStreams: m.IsStreamingServer()},
		full, grpc.ForceCodecV2(rawCodec{}))
	if err != nil {
		return err
	}
	if err := st.SendMsg(&body); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_ = st.CloseSend()
	for {
		var out []byte
		if err := st.RecvMsg(&out); err != nil {
			return err
		}
	}
}

// TestMalformedRequestsOnEveryRPC sends invalid UTF-8 in a string field
// and a truncated message to every method of every service each of the
// four servers lists (health and reflection included), over real
// listeners with the internal token: each answer is INVALID_ARGUMENT with
// reason MALFORMED_REQUEST, and each call is in grpc_server_handled_total.
func TestMalformedRequestsOnEveryRPC(t *testing.T) {
	addrs, metricsURL := startMetricsSuite(t)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+token)
	total := 0
	for name, addr := range addrs {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		require.Eventually(t, func() bool {
			resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
			return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
		}, 60*time.Second, 50*time.Millisecond, "%s never became SERVING", name)

		type rpc struct{ service, method string }
		want := map[rpc]int{} // malformed calls sent
		services := listed(t, ctx, conn)
		require.NotEmpty(t, services)
		for _, svc := range services {
			d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
			require.NoError(t, err, "descriptor of %s", svc)
			methods := d.(protoreflect.ServiceDescriptor).Methods()
			for i := range methods.Len() {
				m := methods.Get(i)
				bodies := map[string][]byte{"truncated": truncated}
				if b := invalidUTF8(m.Input(), 3); b != nil {
					bodies["invalid utf-8"] = b
				}
				if len(bodies) == 1 { // only an empty request (grpc.health.v1.HealthListRequest) has none
					require.Zero(t, m.Input().Fields().Len(), "%s/%s has fields but no string to break", svc, m.Name())
				}
				for kind, body := range bodies {
					err := call(ctx, conn, m, body)
					require.Equal(t, codes.InvalidArgument, status.Code(err), "%s %s/%s: %v", name, svc, m.Name(), err)
					require.Equal(t, grpcserver.ReasonMalformedRequest, apierr.Reason(err), "%s %s/%s %s", name, svc, m.Name(), kind)
					want[rpc{svc, string(m.Name())}]++
					total++
				}
			}
		}
		// Every call is counted, by method, with its code.
		resp, err := http.Get(metricsURL[name])
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for r, n := range want {
			re := regexp.MustCompile(`grpc_server_handled_total\{grpc_code="InvalidArgument",grpc_method="` + r.method +
				`",grpc_service="` + regexp.QuoteMeta(r.service) + `",grpc_type="[a-z_]+"\} (\d+)`)
			mm := re.FindSubmatch(body)
			require.NotNil(t, mm, "%s: %s/%s not counted", name, r.service, r.method)
			got, _ := strconv.Atoi(string(mm[1]))
			require.Equal(t, n, got, "%s: %s/%s", name, r.service, r.method)
		}
	}
	t.Logf("%d malformed calls over %d servers, each MALFORMED_REQUEST and counted", total, len(addrs))
}
