package proxy

import (
	"strings"

	"agentplane.dev/pkg/gitrepo"
)

// PushPolicy decides which ref updates the git route forwards. The rule
// (docs/worktrees.md, "Push policy"): a command is admitted only when it
// creates or updates a branch refs/heads/<prefix><name>; a delete, a tag,
// any other ref (the default branch included: it is outside the prefix)
// is refused, and one refused command refuses the whole push. Within the
// prefix an update is admitted whatever its ancestry: the route cannot
// tell a fast-forward from a force without the repository's objects, and
// the prefix is the agent's own namespace, so a forced update can only
// rewrite a branch the agent pushed.
type PushPolicy struct {
	BranchPrefix string // "": gitrepo.DefaultPushBranchPrefix
}

// Refusal reasons, as metric labels (agentplane_credential_proxy_denials_total).
const (
	pushRefDenied    = "git_push_ref_denied"
	pushDeleteDenied = "git_push_delete_denied"
)

// Check returns "" when c is admitted, else the metric reason and the
// message the client shows after "agentplane: ".
func (p PushPolicy) Check(c PushCommand) (reason, msg string) {
	prefix := p.BranchPrefix
	if prefix == "" {
		prefix = gitrepo.DefaultPushBranchPrefix
	}
	if c.Delete() {
		return pushDeleteDenied, "deleting a ref is not allowed"
	}
	name, ok := strings.CutPrefix(c.Ref, "refs/heads/"+prefix)
	if !ok || name == "" || !gitrepo.SafeRefName(c.Ref) {
		return pushRefDenied, "only branches " + prefix + "* may be pushed"
	}
	return "", ""
}

// CheckAll checks every command; it returns nil when all are admitted,
// else the per-command messages ("" for an admitted one) and the first
// refusal's reason.
func (p PushPolicy) CheckAll(cmds []PushCommand) (msgs []string, reason string) {
	for i, c := range cmds {
		r, m := p.Check(c)
		if r == "" {
			continue
		}
		if msgs == nil {
			msgs = make([]string, len(cmds))
			reason = r
		}
		msgs[i] = m
	}
	return msgs, reason
}
