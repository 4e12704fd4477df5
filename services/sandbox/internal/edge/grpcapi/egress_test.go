package grpcapi

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
)

// A bad policy is refused before the driver sees it (D is nil here: a
// call that reached it would panic).
func TestUpdateEgressPolicyRefusesBadInput(t *testing.T) {
	s := &Sandbox{}
	_, err := s.UpdateEgressPolicy(context.Background(), &sandboxv1.UpdateEgressPolicyRequest{
		SessionId: "s1", SandboxId: "sb1", Version: 0, Tenant: &sandboxv1.Tenant{OrgId: "o1", UserId: "u1"},
		Egress: &sandboxv1.EgressPolicy{Allow: []*sandboxv1.EgressRule{{Host: "*."}, {Host: "ok.example", Ports: []uint32{0}}}},
	})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, ReasonInvalidEgress, apierr.Reason(err))
	var fields []string
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				fields = append(fields, v.GetField())
			}
		}
	}
	require.ElementsMatch(t, []string{"version", "egress.allow[0].host", "egress.allow[1].ports[0]"}, fields)
}
