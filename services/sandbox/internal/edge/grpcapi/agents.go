package grpcapi

import (
	"context"
	"slices"

	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/store"
)

// ReasonAgentUnavailable is an unknown or uninstalled agent profile, or a
// model name the profile cannot take.
const ReasonAgentUnavailable = "AGENT_UNAVAILABLE"

// toolKinds are ACP's ToolKind values, the vocabulary of a permission policy.
var toolKinds = []string{"read", "edit", "delete", "move", "search", "execute", "think", "fetch", "switch_mode", "other"}

// checkAgent validates the shape of an agent choice (whether the profile
// exists is the registry's answer).
func checkAgent(v *violations, field string, a *sandboxv1.Agent) {
	if a == nil {
		return
	}
	v.check(len(a.GetProfile()) <= 64, field+".profile", "at most 64 bytes")
	v.check(len(a.GetModel()) <= 128, field+".model", "at most 128 bytes")
	v.check(len(a.GetRejectToolKinds()) <= len(toolKinds), field+".reject_tool_kinds", "at most one entry per tool kind")
	for _, k := range a.GetRejectToolKinds() {
		v.check(slices.Contains(toolKinds, k), field+".reject_tool_kinds", "ACP tool kinds: read, edit, delete, move, search, execute, think, fetch, switch_mode, other")
	}
}

func agentToStore(a *sandboxv1.Agent) store.Agent {
	return store.Agent{Profile: a.GetProfile(), Model: a.GetModel(), RejectToolKinds: a.GetRejectToolKinds()}
}

// CheckAgent resolves an agent profile without preparing anything.
func (s *Sandbox) CheckAgent(ctx context.Context, req *sandboxv1.CheckAgentRequest) (*sandboxv1.CheckAgentResponse, error) {
	var v violations
	checkAgent(&v, "agent", req.GetAgent())
	if err := v.err("invalid agent"); err != nil {
		return nil, err
	}
	spec, err := s.Driver.ResolveAgent(req.GetAgent().GetProfile(), req.GetAgent().GetModel())
	if err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.CheckAgentResponse{Protocol: spec.Protocol, Agent: &sandboxv1.Agent{
		Profile: spec.Profile, Model: spec.Model, RejectToolKinds: req.GetAgent().GetRejectToolKinds()}}, nil
}

// CheckWorktree says whether a new session may join a directory: its
// repository and agent must be the directory's (driver.CheckWorktree).
func (s *Sandbox) CheckWorktree(ctx context.Context, req *sandboxv1.CheckWorktreeRequest) (*sandboxv1.CheckWorktreeResponse, error) {
	var v violations
	v.check(validSandboxID(req.GetSandboxId()), "sandbox_id", sandboxIDRule)
	v.check(validDirectory(req.GetDirectory()), "directory", "an absolute normalized path")
	v.check(len(req.GetRepoUrl()) <= 2048, "repo_url", "at most 2048 bytes")
	checkAgent(&v, "agent", req.GetAgent())
	if err := v.err("invalid worktree check"); err != nil {
		return nil, err
	}
	if err := s.Driver.CheckWorktree(ctx, req.GetSandboxId(), req.GetDirectory(), req.GetRepoUrl(), agentToStore(req.GetAgent())); err != nil {
		return nil, toStatus(ctx, s.Log, err)
	}
	return &sandboxv1.CheckWorktreeResponse{}, nil
}
