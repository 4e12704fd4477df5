package grpcapi

import (
	"regexp"

	"google.golang.org/protobuf/types/known/timestamppb"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/pkg/ident"
	"agentplane.dev/services/ingest/internal/history"
	"agentplane.dev/services/ingest/internal/scope"
)

func itemsFromProto(pbs []*ingestv1.Item) []history.Item {
	items := make([]history.Item, len(pbs))
	for i, pb := range pbs {
		items[i] = history.Item{
			ID: pb.GetItemId(), Type: history.Type(pb.GetType()), Version: pb.GetVersion(),
			ParentID: pb.GetParentId(), Payload: pb.GetPayload(),
		}
		if pb.Time != nil {
			items[i].Time = pb.GetTime().AsTime()
		}
	}
	return items
}

func itemToProto(it history.Item) *ingestv1.Item {
	pb := &ingestv1.Item{
		ItemId: it.ID, Type: ingestv1.ItemType(it.Type), Version: it.Version,
		ParentId: it.ParentID, Payload: it.Payload,
	}
	if !it.Time.IsZero() {
		pb.Time = timestamppb.New(it.Time)
	}
	return pb
}

func runtimeSessionToProto(rs history.RuntimeSession) *ingestv1.RuntimeSession {
	return &ingestv1.RuntimeSession{
		RuntimeSessionId: rs.ID, SessionId: rs.SessionID, SandboxId: rs.SandboxID,
		Directory: rs.Directory, CreateTime: timestamppb.New(rs.CreateTime),
	}
}

// scopeFromProto converts scope metadata and reports the violations of a malformed one.
func scopeFromProto(pb *ingestv1.ScopeMetadata) (scope.Metadata, []history.Violation) {
	switch v := pb.GetVersion().(type) {
	case *ingestv1.ScopeMetadata_V1:
		return scope.Metadata{V1: &scope.V1{RuntimeSessionID: v.V1.GetRuntimeSessionId()}}, nil // compared with the validated target
	case *ingestv1.ScopeMetadata_V2:
		vs := history.ValidateRef("scope.v2.sandbox_id", v.V2.GetSandboxId(), ident.ID)
		vs = append(vs, history.ValidateRef("scope.v2.directory", v.V2.GetDirectory(), ident.Directory)...)
		vs = append(vs, history.ValidateRuntimeSessionID("scope.v2.resolving_runtime_session_id", v.V2.GetResolvingRuntimeSessionId())...)
		// The tenant is required: without it the check could not hold a
		// scope to one tenant.
		vs = append(vs, history.ValidateRef("scope.v2.org_id", v.V2.GetOrgId(), ident.ID)...)
		vs = append(vs, history.ValidateRef("scope.v2.user_id", v.V2.GetUserId(), ident.ID)...)
		return scope.Metadata{V2: &scope.V2{
			SandboxID: v.V2.GetSandboxId(), Directory: v.V2.GetDirectory(),
			ResolvingRuntimeSessionID: v.V2.GetResolvingRuntimeSessionId(),
			Tenant:                    scope.Tenant{Org: v.V2.GetOrgId(), User: v.V2.GetUserId()},
		}}, vs
	default:
		return scope.Metadata{}, nil
	}
}

// cursorPattern is an item cursor (stream entry id and index), the only cursor Tail accepts.
var cursorPattern = regexp.MustCompile(`^[0-9]{1,20}-[0-9]{1,20}-[0-9]{1,9}$`)

func validCursor(c string) bool { return c == "" || cursorPattern.MatchString(c) }
