// Package grpcapi serves CredentialService: it converts proto to domain
// values, validates requests with field violations, and translates every
// domain error in one place (toStatus).
package grpcapi

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	"agentplane.dev/pkg/apierr"
	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/pkg/gitrepo"
	"agentplane.dev/pkg/ident"
	"agentplane.dev/pkg/storeerr"
	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/handle"
	"agentplane.dev/services/credential/internal/scope"
)

// Reasons returned by this service (listed in docs/errors.md).
const (
	ReasonInvalidRequest        = "INVALID_REQUEST"
	ReasonCredentialNotFound    = "CREDENTIAL_NOT_FOUND"
	ReasonCredentialClassMixed  = "CREDENTIAL_CLASS_MIXED"
	ReasonScopeHandleConflict   = "SCOPE_HANDLE_CONFLICT"
	ReasonScopeHandleNotFound   = "SCOPE_HANDLE_NOT_FOUND"
	ReasonContractDowngrade     = "RUNTIME_CONTRACT_DOWNGRADE"
	ReasonNotWorktree           = "SCOPE_NOT_WORKTREE"
	ReasonStaleFenceToken       = "STALE_FENCE_TOKEN"
	ReasonScopeBusy             = "SCOPE_BUSY"
	ReasonHandleInvalid         = "HANDLE_INVALID"
	ReasonHandleSandboxMismatch = "HANDLE_SANDBOX_MISMATCH"
	ReasonInternal              = "INTERNAL"
	ReasonTenantMismatch        = "SANDBOX_TENANT_MISMATCH"
)

// Server implements credentialv1.CredentialServiceServer.
type Server struct {
	credentialv1.UnimplementedCredentialServiceServer
	svc *grants.Service
	log *slog.Logger
}

// New returns the handlers over svc.
func New(svc *grants.Service, log *slog.Logger) *Server { return &Server{svc: svc, log: log} }

// toStatus is the service's one error translator. Messages never carry a
// handle, a secret or internal error text.
func (s *Server) toStatus(ctx context.Context, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, grants.ErrCredentialNotFound):
		return apierr.Error(codes.NotFound, ReasonCredentialNotFound, "backing credential not found", apierr.FieldViolation("credential_ref", "unknown reference"))
	case errors.Is(err, grants.ErrClassMismatch):
		return apierr.Error(codes.InvalidArgument, ReasonInvalidRequest, "credential class does not match the stored credential", apierr.FieldViolation("credential_class", "differs from the stored credential's class"))
	case errors.Is(err, scope.ErrClassMixed):
		return apierr.Error(codes.FailedPrecondition, ReasonCredentialClassMixed, "the directory already uses another credential class")
	case errors.Is(err, scope.ErrHandleConflict):
		return apierr.Error(codes.FailedPrecondition, ReasonScopeHandleConflict, "the scope holds a handle this fence never accepted; retire the scope first")
	case errors.Is(err, scope.ErrNoHandle):
		return apierr.Error(codes.NotFound, ReasonScopeHandleNotFound, "the scope holds no current worktree handle")
	case errors.Is(err, scope.ErrContractDowngrade):
		return apierr.Error(codes.FailedPrecondition, ReasonContractDowngrade, "the directory is pinned to the worktree contract")
	case errors.Is(err, scope.ErrNotWorktree):
		return apierr.Error(codes.FailedPrecondition, ReasonNotWorktree, "only worktree handles rotate")
	case errors.Is(err, grants.ErrStaleFence):
		return apierr.Error(codes.FailedPrecondition, ReasonStaleFenceToken, "a newer sandbox owner fencing token was seen for this scope")
	case errors.Is(err, grants.ErrBusy):
		return apierr.Error(codes.Aborted, ReasonScopeBusy, "the scope kept changing; retry", apierr.RetryAfter(100*time.Millisecond))
	case errors.Is(err, grants.ErrMalformedHandle), errors.Is(err, scope.ErrUnknownHandle), errors.Is(err, scope.ErrNoLiveMember):
		return apierr.Error(codes.Unauthenticated, ReasonHandleInvalid, "handle invalid, expired, revoked or without a live member")
	case errors.Is(err, scope.ErrTenantMismatch):
		return apierr.Error(codes.PermissionDenied, ReasonTenantMismatch, "the scope belongs to another tenant")
	case errors.Is(err, scope.ErrSandboxMismatch):
		return apierr.Error(codes.PermissionDenied, ReasonHandleSandboxMismatch, "handle belongs to another sandbox")
	case ctx.Err() == nil && errors.Is(err, storeerr.ErrNotReplicated):
		s.log.WarnContext(ctx, "write not confirmed on the state store's replicas", "error", err)
		return apierr.StoreNotReplicated()
	case ctx.Err() == nil && storeerr.Unavailable(err):
		s.log.WarnContext(ctx, "state store unavailable", "error", err)
		return apierr.StoreUnavailable()
	}
	return apierr.Unexpected(ctx, s.log, err)
}

type violations []apierr.Option

func (v *violations) need(ok bool, field, desc string) {
	if !ok {
		*v = append(*v, apierr.FieldViolation(field, desc))
	}
}

func (v violations) err() error {
	if len(v) == 0 {
		return nil
	}
	return apierr.Error(codes.InvalidArgument, ReasonInvalidRequest, "invalid request", v...)
}

func (v *violations) scope(sc *credentialv1.Scope) scope.Scope {
	v.id("scope.sandbox_id", sc.GetSandboxId())
	v.directory("scope.directory", sc.GetDirectory())
	return scope.Scope{SandboxID: sc.GetSandboxId(), Directory: sc.GetDirectory()}
}

// id and directory check ids and worktree directories as every API does
// (pkg/ident): an internal caller gets no "..", "s/.." or "../x" past them.
func (v *violations) id(field, s string) {
	if d := ident.ID(s); d != "" {
		*v = append(*v, apierr.FieldViolation(field, d))
	}
}

func (v *violations) optionalID(field, s string) {
	if s != "" {
		v.id(field, s)
	}
}

func (v *violations) directory(field, s string) {
	if d := ident.Directory(s); d != "" {
		*v = append(*v, apierr.FieldViolation(field, d))
	}
}

func (v *violations) class(c credentialv1.CredentialClass, field string) scope.Class {
	switch c {
	case credentialv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED:
		return scope.Delegated
	case credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC:
		return scope.Static
	}
	v.need(false, field, "delegated or static")
	return ""
}

func (v *violations) member(m *credentialv1.Member, ref string) scope.Member {
	v.id("member.session_id", m.GetSessionId())
	v.id("member.runtime_session_id", m.GetRuntimeSessionId())
	v.id("member.user_id", m.GetUserId())
	v.optionalID("member.org_id", m.GetOrgId())
	v.id("credential_ref", ref)
	return scope.Member{SessionID: m.GetSessionId(), RuntimeSessionID: m.GetRuntimeSessionId(), UserID: m.GetUserId(), OrgID: m.GetOrgId(), CredentialRef: ref}
}

func (v *violations) gitRef(ref string) string {
	v.need(len(ref) <= 512, "git_credential_ref", "at most 512 bytes")
	return ref
}

func (v *violations) fence(t uint64) uint64 {
	v.need(t != 0, "fence_token", "required (the sandbox owner's fencing token)")
	return t
}

func classToProto(c scope.Class) credentialv1.CredentialClass {
	switch c {
	case scope.Delegated:
		return credentialv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED
	case scope.Static:
		return credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC
	}
	return credentialv1.CredentialClass_CREDENTIAL_CLASS_UNSPECIFIED
}

func memberToProto(m scope.Member) *credentialv1.Member {
	return &credentialv1.Member{SessionId: m.SessionID, RuntimeSessionId: m.RuntimeSessionID, UserId: m.UserID, OrgId: m.OrgID}
}

func grantToProto(g grants.Grant) *credentialv1.Grant {
	kind := credentialv1.HandleKind_HANDLE_KIND_WORKTREE
	if g.Kind == handle.PerSession {
		kind = credentialv1.HandleKind_HANDLE_KIND_PER_SESSION
	}
	out := &credentialv1.Grant{
		HandleDigest: g.Digest, Kind: kind,
		Scope:           &credentialv1.Scope{SandboxId: g.Scope.SandboxID, Directory: g.Scope.Directory},
		IssuerSessionId: g.Issuer, CredentialClass: classToProto(g.Class),
		ExpireTime: timestamppb.New(g.ExpireAt), FenceToken: g.Fence,
	}
	for _, m := range g.Members {
		out.Members = append(out.Members, memberToProto(m))
	}
	return out
}

// PutBackingCredential stores a secret sealed.
func (s *Server) PutBackingCredential(ctx context.Context, req *credentialv1.PutBackingCredentialRequest) (*credentialv1.PutBackingCredentialResponse, error) {
	var v violations
	v.id("session_id", req.GetSessionId())
	class := v.class(req.GetCredentialClass(), "credential_class")
	// A repository credential may have no secret: the session's repository
	// is then cloned anonymously, still only through the git route.
	v.need(req.GetSecret() != "" || req.GetRepoUrl() != "", "secret", "required")
	v.need(len(req.GetSecret()) <= 16<<10, "secret", "at most 16 KiB")
	if req.GetRepoUrl() != "" || req.GetGitUsername() != "" || req.GetGitPushBranchPrefix() != "" {
		_, err := gitrepo.Parse(req.GetRepoUrl())
		v.need(err == nil, "repo_url", "an http(s) repository URL without credentials, query or fragment")
		v.need(gitrepo.ValidPushPrefix(req.GetGitPushBranchPrefix()), "git_push_branch_prefix", gitrepo.PushPrefixRule)
		v.need(len(req.GetGitUsername()) <= 256 && !strings.ContainsAny(req.GetGitUsername(), ":\r\n"), "git_username", "at most 256 bytes, no colon or line break")
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	var ref, digest string
	var err error
	if req.GetRepoUrl() != "" {
		ref, digest, err = s.svc.PutGitCredential(ctx, req.GetSessionId(), req.GetRepoUrl(), req.GetGitUsername(), req.GetGitPushBranchPrefix(), []byte(req.GetSecret()))
	} else {
		ref, digest, err = s.svc.PutCredential(ctx, req.GetSessionId(), class, []byte(req.GetSecret()))
	}
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.PutBackingCredentialResponse{CredentialRef: ref, SecretDigest: digest}, nil
}

// DeleteBackingCredential deletes a secret; idempotent.
func (s *Server) DeleteBackingCredential(ctx context.Context, req *credentialv1.DeleteBackingCredentialRequest) (*credentialv1.DeleteBackingCredentialResponse, error) {
	var v violations
	v.id("credential_ref", req.GetCredentialRef())
	if err := v.err(); err != nil {
		return nil, err
	}
	if err := s.svc.DeleteCredential(ctx, req.GetCredentialRef()); err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.DeleteBackingCredentialResponse{}, nil
}

// MintHandle issues or returns the scope's handle.
func (s *Server) MintHandle(ctx context.Context, req *credentialv1.MintHandleRequest) (*credentialv1.MintHandleResponse, error) {
	var v violations
	sc := v.scope(req.GetScope())
	j := scope.Join{
		Member: v.member(req.GetMember(), req.GetCredentialRef()), Class: v.class(req.GetCredentialClass(), "credential_class"),
		Fence: v.fence(req.GetFenceToken()), AllocationID: req.GetAllocationId(),
	}
	j.Member.GitCredentialRef = v.gitRef(req.GetGitCredentialRef())
	switch req.GetContract() {
	case credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE:
		j.Contract = scope.Worktree
	case credentialv1.RuntimeContract_RUNTIME_CONTRACT_PER_SESSION, credentialv1.RuntimeContract_RUNTIME_CONTRACT_UNSPECIFIED:
		j.Contract = scope.PerSession // a missing contract means per_session (DESIGN 5)
	default:
		v.need(false, "contract", "worktree or per_session")
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	raw, g, adopted, err := s.svc.Mint(ctx, sc, j)
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.MintHandleResponse{Handle: raw, Grant: grantToProto(g), Adopted: adopted}, nil
}

// AdoptHandle gives a joining sibling the canonical handle.
func (s *Server) AdoptHandle(ctx context.Context, req *credentialv1.AdoptHandleRequest) (*credentialv1.AdoptHandleResponse, error) {
	var v violations
	sc := v.scope(req.GetScope())
	j := scope.Join{
		Member: v.member(req.GetMember(), req.GetCredentialRef()), Class: v.class(req.GetCredentialClass(), "credential_class"),
		Fence: v.fence(req.GetFenceToken()), Contract: scope.Worktree,
	}
	j.Member.GitCredentialRef = v.gitRef(req.GetGitCredentialRef())
	if err := v.err(); err != nil {
		return nil, err
	}
	raw, g, err := s.svc.Adopt(ctx, sc, j)
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.AdoptHandleResponse{Handle: raw, Grant: grantToProto(g)}, nil
}

// RotateHandle replaces the scope's handle for every member.
func (s *Server) RotateHandle(ctx context.Context, req *credentialv1.RotateHandleRequest) (*credentialv1.RotateHandleResponse, error) {
	var v violations
	sc := v.scope(req.GetScope())
	tok := v.fence(req.GetFenceToken())
	if err := v.err(); err != nil {
		return nil, err
	}
	raw, g, until, err := s.svc.Rotate(ctx, sc, tok)
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.RotateHandleResponse{Handle: raw, Grant: grantToProto(g), PreviousValidUntil: timestamppb.New(until)}, nil
}

// ResolveHandle checks a handle; the secret never leaves the service.
func (s *Server) ResolveHandle(ctx context.Context, req *credentialv1.ResolveHandleRequest) (*credentialv1.ResolveHandleResponse, error) {
	var v violations
	v.need(req.GetHandle() != "", "handle", "required")
	v.id("sandbox_id", req.GetSandboxId())
	if err := v.err(); err != nil {
		return nil, err
	}
	r, err := s.svc.Resolve(ctx, req.GetHandle(), req.GetSandboxId())
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.ResolveHandleResponse{Grant: grantToProto(r.Grant), ResolvingMember: memberToProto(r.Member)}, nil
}

// ReleaseMember removes a member; the last one retires the scope.
func (s *Server) ReleaseMember(ctx context.Context, req *credentialv1.ReleaseMemberRequest) (*credentialv1.ReleaseMemberResponse, error) {
	var v violations
	sc := v.scope(req.GetScope())
	v.id("session_id", req.GetSessionId())
	tok := v.fence(req.GetFenceToken())
	if err := v.err(); err != nil {
		return nil, err
	}
	retired, remaining, err := s.svc.Release(ctx, sc, req.GetSessionId(), tok)
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.ReleaseMemberResponse{ScopeRetired: retired, RemainingMembers: int32(remaining)}, nil
}

// RetireScope retires every accepted handle of a scope.
func (s *Server) RetireScope(ctx context.Context, req *credentialv1.RetireScopeRequest) (*credentialv1.RetireScopeResponse, error) {
	var v violations
	sc := v.scope(req.GetScope())
	tok := v.fence(req.GetFenceToken())
	switch req.GetReason() {
	case credentialv1.RetireReason_RETIRE_REASON_WRAPPER_RESTART, credentialv1.RetireReason_RETIRE_REASON_ALLOCATION_CHANGE,
		credentialv1.RetireReason_RETIRE_REASON_LAST_MEMBER_LEFT:
	default:
		v.need(false, "reason", "required")
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	n, err := s.svc.Retire(ctx, sc, req.GetReason() == credentialv1.RetireReason_RETIRE_REASON_LAST_MEMBER_LEFT, tok)
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	return &credentialv1.RetireScopeResponse{RetiredHandles: int32(n)}, nil
}

// CheckScopeMember answers ingest's v2 scope check.
func (s *Server) CheckScopeMember(ctx context.Context, req *credentialv1.CheckScopeMemberRequest) (*credentialv1.CheckScopeMemberResponse, error) {
	var v violations
	sc := v.scope(req.GetScope())
	v.id("runtime_session_id", req.GetRuntimeSessionId())
	if req.GetOrgId() != "" || req.GetUserId() != "" {
		v.id("org_id", req.GetOrgId())
		v.id("user_id", req.GetUserId())
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	m, live, err := s.svc.CheckMember(ctx, sc, req.GetRuntimeSessionId())
	if err != nil {
		return nil, s.toStatus(ctx, err)
	}
	if live && req.GetOrgId() != "" && (m.OrgID != req.GetOrgId() || m.UserID != req.GetUserId()) {
		// A member of another tenant is nobody the caller may reach.
		return &credentialv1.CheckScopeMemberResponse{}, nil
	}
	return &credentialv1.CheckScopeMemberResponse{Live: live, SessionId: m.SessionID}, nil
}
