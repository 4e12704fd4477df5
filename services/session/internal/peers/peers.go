// Package peers adapts the sandbox, credential and ingest gRPC clients to the
// session service's small peer interfaces, converting between their
// contracts and the session domain.
package peers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/pkg/gitrepo"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/pkg/grpcclient"
	"agentplane.dev/services/session/internal/service"
	"agentplane.dev/services/session/internal/session"
)

// SandboxRouter sends sandbox calls to the replica that owns the sandbox
// (see grpcclient.OwnerRouter), with connections dialled through conns.
func SandboxRouter(conns *grpcclient.Conns) *grpcclient.OwnerRouter {
	return grpcclient.NewOwnerRouter(conns, ReasonSandboxOwnedElsewhere, SandboxKey)
}

// ReasonSandboxTenantMismatch is the sandbox service's answer to a call
// naming a sandbox of another tenant (docs/errors.md).
const ReasonSandboxTenantMismatch = "SANDBOX_TENANT_MISMATCH"

// ReasonRuntimeShared is the sandbox service's refusal to suspend a
// runtime other sessions share (docs/errors.md).
const ReasonRuntimeShared = "RUNTIME_SHARED"

// ReasonSandboxOwnedElsewhere is the sandbox service's answer from a
// replica that does not own the sandbox (docs/errors.md).
const ReasonSandboxOwnedElsewhere = "SANDBOX_OWNED_ELSEWHERE"

// SandboxKey is the sandbox a SandboxService request is about ("" for none).
func SandboxKey(req any) string {
	switch r := req.(type) {
	case interface{ GetRoute() *sandboxv1.RouteSpec }:
		return r.GetRoute().GetSandboxId()
	case interface{ GetSandboxId() string }:
		return r.GetSandboxId()
	}
	return ""
}

// Sandbox is service.Sandbox over SandboxService.
type Sandbox struct {
	C sandboxv1.SandboxServiceClient
}

var _ service.Sandbox = Sandbox{}

func routeSpec(s *session.Session) *sandboxv1.RouteSpec {
	class := sandboxv1.CredentialClass_CREDENTIAL_CLASS_STATIC
	if s.CredentialClass == session.CredentialDelegated {
		class = sandboxv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED
	}
	return &sandboxv1.RouteSpec{
		SessionId: s.ID, SandboxId: s.SandboxID, Directory: s.Directory, RepoUrl: s.RepoURL,
		UserId: s.UserID, OrgId: s.OrgID, CredentialRef: s.CredentialRef, CredentialClass: class,
		Agent:   agentProto(s.Agent),
		RepoRef: s.RepoRef, RepoDepth: s.RepoDepth, GitCredentialRef: s.GitCredentialRef,
		Egress: egressProto(s.Egress), EgressVersion: s.EgressVersion,
	}
}

// tenant is the session's tenant as every SandboxService call names it:
// from the session's stored owner, never from anything a runtime sent.
func tenant(s *session.Session) *sandboxv1.Tenant {
	return &sandboxv1.Tenant{OrgId: s.OrgID, UserId: s.UserID}
}

func egressProto(p egresspolicy.Policy) *sandboxv1.EgressPolicy {
	if p.Empty() {
		return nil
	}
	out := &sandboxv1.EgressPolicy{PrivateNetworks: p.PrivateNetworks}
	for _, r := range p.Allow {
		out.Allow = append(out.Allow, &sandboxv1.EgressRule{Host: r.Host, Ports: r.Ports})
	}
	return out
}

// UpdateEgress sends the session's egress policy to its sandbox.
func (p Sandbox) UpdateEgress(ctx context.Context, s *session.Session) error {
	_, err := p.C.UpdateEgressPolicy(ctx, &sandboxv1.UpdateEgressPolicyRequest{
		SessionId: s.ID, SandboxId: s.SandboxID, Egress: egressProto(s.Egress), Version: s.EgressVersion, Tenant: tenant(s)})
	return err
}

func agentProto(a session.Agent) *sandboxv1.Agent {
	if a.Profile == "" && a.Model == "" && len(a.RejectToolKinds) == 0 {
		return nil
	}
	return &sandboxv1.Agent{Profile: a.Profile, Model: a.Model, RejectToolKinds: a.RejectToolKinds}
}

// CheckAgent asks the sandbox service to resolve the agent; its
// AGENT_UNAVAILABLE refusal becomes session.ErrAgentUnavailable, any other
// failure a peer outage.
func (p Sandbox) CheckAgent(ctx context.Context, a session.Agent) (session.Agent, error) {
	resp, err := p.C.CheckAgent(ctx, &sandboxv1.CheckAgentRequest{Agent: agentProto(a)})
	if err != nil {
		if apierr.Reason(err) == "AGENT_UNAVAILABLE" {
			// The sandbox's message starts with the same words: say them once.
			msg := strings.TrimPrefix(status.Convert(err).Message(), session.ErrAgentUnavailable.Error()+": ")
			return session.Agent{}, fmt.Errorf("%w: %s", session.ErrAgentUnavailable, msg)
		}
		return session.Agent{}, fmt.Errorf("%w: sandbox: %w", session.ErrPeerUnavailable, err)
	}
	got := resp.GetAgent()
	return session.Agent{Profile: got.GetProfile(), Model: got.GetModel(), RejectToolKinds: a.RejectToolKinds}, nil
}

// CheckWorktree asks the sandbox service whether the new session s may join
// its directory; its WORKTREE_REPO_MISMATCH and AGENT_MISMATCH refusals
// become the session's errors of the same reason.
func (p Sandbox) CheckWorktree(ctx context.Context, s *session.Session) error {
	_, err := p.C.CheckWorktree(ctx, &sandboxv1.CheckWorktreeRequest{SandboxId: s.SandboxID, Directory: s.Directory,
		RepoUrl: s.RepoURL, Agent: agentProto(s.Agent)})
	switch {
	case err == nil:
		return nil
	case apierr.Reason(err) == "WORKTREE_REPO_MISMATCH":
		return fmt.Errorf("%w: %s", session.ErrWorktreeRepoMismatch, status.Convert(err).Message())
	case apierr.Reason(err) == "AGENT_MISMATCH":
		return fmt.Errorf("%w: %s", session.ErrAgentMismatch, status.Convert(err).Message())
	}
	return fmt.Errorf("%w: sandbox: %w", session.ErrPeerUnavailable, err)
}

func routeView(v *sandboxv1.RouteView) session.RouteView {
	out := session.RouteView{
		Step: v.GetStep(), FailureReason: v.GetFailureReason(),
		RuntimeSessionID: v.GetRuntimeSessionId(), WrapperInstance: v.GetWrapperInstance(),
	}
	switch v.GetState() {
	case sandboxv1.RouteState_ROUTE_STATE_PREPARING:
		out.State = session.RoutePreparing
	case sandboxv1.RouteState_ROUTE_STATE_READY:
		out.State = session.RouteReady
	case sandboxv1.RouteState_ROUTE_STATE_RECONNECTING:
		out.State = session.RouteReconnecting
	case sandboxv1.RouteState_ROUTE_STATE_FAILED:
		out.State = session.RouteFailed
	default:
		out.State = session.RouteUnknown
	}
	return out
}

// ClaimSandbox binds the sandbox to the tenant or refuses it
// (session.ErrSandboxTenantMismatch); any other failure is a peer outage.
func (p Sandbox) ClaimSandbox(ctx context.Context, sandboxID string, t session.Tenant) error {
	_, err := p.C.ClaimSandbox(ctx, &sandboxv1.ClaimSandboxRequest{SandboxId: sandboxID, Tenant: &sandboxv1.Tenant{OrgId: t.Org, UserId: t.User}})
	switch {
	case err == nil:
		return nil
	case apierr.Reason(err) == ReasonSandboxTenantMismatch:
		return session.ErrSandboxTenantMismatch
	}
	return fmt.Errorf("%w: sandbox: %w", session.ErrPeerUnavailable, err)
}

func (p Sandbox) Prepare(ctx context.Context, s *session.Session, restart bool) (session.RouteView, error) {
	resp, err := p.C.Prepare(ctx, &sandboxv1.PrepareRequest{Route: routeSpec(s), Restart: restart})
	if err != nil {
		return session.RouteView{}, err
	}
	return routeView(resp.GetRoute()), nil
}

func (p Sandbox) Deliver(ctx context.Context, s *session.Session, msgs []*session.Message) (bool, session.RouteView, error) {
	req := &sandboxv1.DeliverRequest{SessionId: s.ID, SandboxId: s.SandboxID, Tenant: tenant(s)}
	for _, m := range msgs {
		req.Messages = append(req.Messages, &sandboxv1.DeliveryMessage{MessageId: m.ID, Content: m.Content})
	}
	resp, err := p.C.Deliver(ctx, req)
	if err != nil {
		return false, session.RouteView{}, err
	}
	switch resp.GetResult() {
	case sandboxv1.DeliveryResult_DELIVERY_RESULT_SENT:
		return true, routeView(resp.GetRoute()), nil
	case sandboxv1.DeliveryResult_DELIVERY_RESULT_NOT_READY:
		return false, routeView(resp.GetRoute()), nil
	}
	return false, session.RouteView{}, fmt.Errorf("deliver: unexpected result %v", resp.GetResult())
}

func (p Sandbox) Abort(ctx context.Context, s *session.Session, messageID string) error {
	_, err := p.C.Abort(ctx, &sandboxv1.AbortRequest{SessionId: s.ID, SandboxId: s.SandboxID, MessageId: messageID, Tenant: tenant(s)})
	return err
}

func (p Sandbox) ReleaseRoute(ctx context.Context, r service.RouteRef, reason string) (service.Release, error) {
	resp, err := p.C.ReleaseRoute(ctx, &sandboxv1.ReleaseRouteRequest{SessionId: r.SessionID, SandboxId: r.SandboxID, Reason: reason,
		Tenant: &sandboxv1.Tenant{OrgId: r.Tenant.Org, UserId: r.Tenant.User}})
	if err != nil {
		if apierr.Reason(err) == ReasonSandboxTenantMismatch {
			return service.Release{}, session.ErrSandboxTenantMismatch
		}
		return service.Release{}, err
	}
	return service.Release{
		LastMember: resp.GetLastMember(), AbsenceVerified: resp.GetAbsenceVerified(),
		ExhaustedFinal: resp.GetLeaseState() == sandboxv1.LeaseState_LEASE_STATE_EXHAUSTED,
		RetryAfter:     resp.GetRetryAfter().AsDuration(),
	}, nil
}

func (p Sandbox) SuspendRoute(ctx context.Context, r service.RouteRef) (bool, time.Duration, error) {
	resp, err := p.C.SuspendRoute(ctx, &sandboxv1.SuspendRouteRequest{SessionId: r.SessionID, SandboxId: r.SandboxID,
		Tenant: &sandboxv1.Tenant{OrgId: r.Tenant.Org, UserId: r.Tenant.User}})
	if err != nil {
		switch apierr.Reason(err) {
		case ReasonSandboxTenantMismatch:
			return false, 0, session.ErrSandboxTenantMismatch
		case ReasonRuntimeShared:
			return false, 0, session.ErrRuntimeShared
		}
		return false, 0, fmt.Errorf("%w: sandbox: %w", session.ErrPeerUnavailable, err)
	}
	return resp.GetAbsenceVerified(), resp.GetRetryAfter().AsDuration(), nil
}

func (p Sandbox) WorktreeChanges(ctx context.Context, s *session.Session) (*gitrepo.Changes, error) {
	resp, err := p.C.WorktreeChanges(ctx, &sandboxv1.WorktreeChangesRequest{SessionId: s.ID, SandboxId: s.SandboxID, Tenant: tenant(s)})
	if err != nil {
		return nil, worktreeErr(err)
	}
	c := resp.GetChanges()
	out := &gitrepo.Changes{Diff: c.GetDiff(), DiffTruncated: c.GetDiffTruncated(), HeadCommit: c.GetHeadCommit(), Time: c.GetTime().AsTime()}
	for _, f := range c.GetFiles() {
		k := gitrepo.FileModified
		switch f.GetKind() {
		case runtimev1.FileChangeKind_FILE_CHANGE_KIND_ADDED:
			k = gitrepo.FileAdded
		case runtimev1.FileChangeKind_FILE_CHANGE_KIND_DELETED:
			k = gitrepo.FileDeleted
		}
		out.Files = append(out.Files, gitrepo.FileChange{Path: f.GetPath(), Kind: k})
	}
	return out, nil
}

func (p Sandbox) PushWorktree(ctx context.Context, s *session.Session, push service.Push) (service.Pushed, error) {
	resp, err := p.C.PushWorktree(ctx, &sandboxv1.PushWorktreeRequest{SessionId: s.ID, SandboxId: s.SandboxID, Branch: push.Branch, CommitMessage: push.Message,
		AuthorName: push.AuthorName, AuthorEmail: push.AuthorEmail, Tenant: tenant(s)})
	if err != nil {
		return service.Pushed{}, worktreeErr(err)
	}
	return service.Pushed{Commit: resp.GetCommitId(), Ref: resp.GetRef(), Committed: resp.GetCommitted()}, nil
}

var fileTypes = map[runtimev1.WorktreeFileType]service.FileType{
	runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_FILE:      service.FileRegular,
	runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_DIRECTORY: service.FileDirectory,
	runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_SYMLINK:   service.FileSymlink,
}

func (p Sandbox) ListWorktreeFiles(ctx context.Context, s *session.Session, l service.FileList) (service.FilePage, error) {
	resp, err := p.C.ListWorktreeFiles(ctx, &sandboxv1.ListWorktreeFilesRequest{SessionId: s.ID, SandboxId: s.SandboxID, Tenant: tenant(s),
		Path: l.Path, After: l.After, Limit: int32(l.Limit)}) //nolint:gosec // at most 1000 (validated)
	if err != nil {
		return service.FilePage{}, worktreeErr(err)
	}
	page := service.FilePage{More: resp.GetMore(), Files: make([]service.WorktreeFile, 0, len(resp.GetFiles()))}
	for _, f := range resp.GetFiles() {
		t, ok := fileTypes[f.GetType()]
		if !ok {
			t = service.FileOther
		}
		page.Files = append(page.Files, service.WorktreeFile{Name: f.GetName(), Type: t, Size: f.GetSize(), Mode: f.GetMode()})
	}
	return page, nil
}

func (p Sandbox) ReadWorktreeFile(ctx context.Context, s *session.Session, r service.FileRead) (service.FileData, error) {
	resp, err := p.C.ReadWorktreeFile(ctx, &sandboxv1.ReadWorktreeFileRequest{SessionId: s.ID, SandboxId: s.SandboxID, Tenant: tenant(s),
		Path: r.Path, Offset: r.Offset, Length: int32(r.Length)}) //nolint:gosec // at most 1 MiB (validated)
	if err != nil {
		return service.FileData{}, worktreeErr(err)
	}
	return service.FileData{Data: resp.GetData(), Size: resp.GetSize()}, nil
}

func (p Sandbox) WriteWorktreeFiles(ctx context.Context, s *session.Session, files []service.FileWrite) (int, int64, error) {
	req := &sandboxv1.WriteWorktreeFilesRequest{SessionId: s.ID, SandboxId: s.SandboxID, Tenant: tenant(s)}
	for _, f := range files {
		req.Files = append(req.Files, &runtimev1.WorktreeFileWrite{Path: f.Path, Data: f.Data, Mode: f.Mode})
	}
	resp, err := p.C.WriteWorktreeFiles(ctx, req)
	if err != nil {
		return 0, 0, worktreeErr(err)
	}
	return int(resp.GetFilesWritten()), resp.GetBytesWritten(), nil
}

// worktreeErr turns the sandbox's worktree refusals (and a route it does
// not know: the session never prepared one) into session.WorktreeError;
// anything else stays a peer failure.
func worktreeErr(err error) error {
	st := status.Convert(err)
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			switch info.GetReason() {
			case "WORKTREE_UNAVAILABLE", "PUSH_REJECTED", "REPO_AUTH_FAILED", "REPO_UNREACHABLE", "INVALID_BRANCH",
				"PATH_ESCAPES_WORKTREE", "FILE_NOT_FOUND", "NOT_A_DIRECTORY", "NOT_A_REGULAR_FILE":
				return &session.WorktreeError{Reason: info.GetReason(), Detail: st.Message(), Retryable: st.Code() == codes.Unavailable}
			case "ROUTE_NOT_FOUND":
				return &session.WorktreeError{Reason: "WORKTREE_UNAVAILABLE", Detail: "the session has no prepared route; send a message first"}
			}
		}
	}
	return fmt.Errorf("%w: sandbox: %s", session.ErrPeerUnavailable, st.Code())
}

// Credentials is service.Credentials over CredentialService.
type Credentials struct {
	C credentialv1.CredentialServiceClient
}

var _ service.Credentials = Credentials{}

func (p Credentials) Put(ctx context.Context, sessionID string, class session.CredentialClass, secret string) (string, error) {
	c := credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC
	if class == session.CredentialDelegated {
		c = credentialv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED
	}
	resp, err := p.C.PutBackingCredential(ctx, &credentialv1.PutBackingCredentialRequest{
		SessionId: sessionID, CredentialClass: c, Secret: secret,
	})
	if err != nil {
		return "", scrub(err)
	}
	return resp.GetCredentialRef(), nil
}

func (p Credentials) PutGit(ctx context.Context, sessionID, repoURL, username, pushPrefix, token string) (string, error) {
	resp, err := p.C.PutBackingCredential(ctx, &credentialv1.PutBackingCredentialRequest{
		SessionId: sessionID, CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: token,
		RepoUrl: repoURL, GitUsername: username, GitPushBranchPrefix: pushPrefix,
	})
	if err != nil {
		return "", scrub(err)
	}
	return resp.GetCredentialRef(), nil
}

func (p Credentials) DeleteBacking(ctx context.Context, ref string) error {
	_, err := p.C.DeleteBackingCredential(ctx, &credentialv1.DeleteBackingCredentialRequest{CredentialRef: ref})
	if status.Code(err) == codes.NotFound {
		return nil
	}
	return err
}

// scrub keeps only the code of a credential-service error: its text is
// never needed here and must not reach logs next to a secret-bearing call.
func scrub(err error) error {
	return errors.New("credential service: " + status.Code(err).String())
}

// History is service.History over IngestService.
type History struct{ C ingestv1.IngestServiceClient }

var _ service.History = History{}

// Export reads one page of a runtime session's history as the internal
// caller (no scope metadata); NOT_FOUND (tombstoned, never written) is
// service.ErrHistoryGone.
func (p History) Export(ctx context.Context, runtimeSessionID, token string, size int) (service.HistoryPage, error) {
	resp, err := p.C.Export(ctx, &ingestv1.ExportRequest{RuntimeSessionId: runtimeSessionID, PageToken: token, PageSize: int32(size)})
	if status.Code(err) == codes.NotFound {
		return service.HistoryPage{}, service.ErrHistoryGone
	}
	if err != nil {
		return service.HistoryPage{}, fmt.Errorf("%w: ingest: %w", session.ErrPeerUnavailable, err)
	}
	out := service.HistoryPage{Next: resp.GetNextPageToken()}
	for _, it := range resp.GetItems() {
		b, err := proto.Marshal(it)
		if err != nil {
			return service.HistoryPage{}, err
		}
		out.Items = append(out.Items, b)
	}
	return out, nil
}

func (p History) Delete(ctx context.Context, runtimeSessionID string) error {
	_, err := p.C.Delete(ctx, &ingestv1.DeleteRequest{RuntimeSessionId: runtimeSessionID})
	if status.Code(err) == codes.NotFound {
		return nil // already tombstoned or never created
	}
	return err
}
