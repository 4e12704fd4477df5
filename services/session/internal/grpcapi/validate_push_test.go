package grpcapi

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// TestValidatePushAuthor: PushWorktree's author is optional; a bad name or
// email is INVALID_REQUEST with a field violation naming it, before any
// state is read.
func TestValidatePushAuthor(t *testing.T) {
	push := func(name, email string) *sessionv1.PushWorktreeRequest {
		return &sessionv1.PushWorktreeRequest{SessionId: "s1", Branch: "agent/x", CommitMessage: "m", AuthorName: name, AuthorEmail: email}
	}
	for _, ok := range []*sessionv1.PushWorktreeRequest{
		push("", ""), push("Ada Lovelace", "ada@example.com"), push("Zoë", ""), push("", "a@b"),
		push(strings.Repeat("n", 256), strings.Repeat("e", 250)+"@x.org"),
	} {
		require.NoError(t, validatePush(ok), "%q %q", ok.GetAuthorName(), ok.GetAuthorEmail())
	}
	bad := []struct{ name, email, field string }{
		{"Eve <eve@x>", "", "author_name"},
		{"Eve\nCommitter: x", "", "author_name"},
		{"Eve\r", "", "author_name"},
		{"nul\x00", "", "author_name"},
		{strings.Repeat("n", 257), "", "author_name"},
		{"", "eve", "author_email"},
		{"", "eve@x@y", "author_email"},
		{"", "eve @x", "author_email"},
		{"", "<eve@x>", "author_email"},
		{"", "eve@x\n", "author_email"},
		{"", strings.Repeat("e", 251) + "@x.org", "author_email"},
	}
	for _, c := range bad {
		err := toStatus(context.Background(), nil, validatePush(push(c.name, c.email)))
		st := status.Convert(err)
		require.Equal(t, codes.InvalidArgument, st.Code(), "%q %q", c.name, c.email)
		var reason string
		var fields []string
		for _, d := range st.Details() {
			switch d := d.(type) {
			case *errdetails.ErrorInfo:
				reason = d.GetReason()
			case *errdetails.BadRequest:
				for _, v := range d.GetFieldViolations() {
					fields = append(fields, v.GetField())
				}
			}
		}
		require.Equal(t, ReasonInvalidRequest, reason)
		require.Equal(t, []string{c.field}, fields, "%q %q", c.name, c.email)
	}
}
