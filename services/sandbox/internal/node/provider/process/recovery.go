package process

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// workspaceRecord is the file PrepareWorkspace writes into a runtime key's
// home: the one entry of a home that preparation recreates.
const workspaceRecord = ".agentplane-workspace"

var _ provider.KeyRecoverer = (*Provider)(nil)

// RecoverKey removes what of one runtime key is verifiably recreatable
// (DESIGN.md 3.4 as amended by issue 33): its home when it holds nothing
// but its workspace record, and its workspace when it is empty and no
// other runtime key uses it. Anything else stays — a workspace with a
// file in it may hold changes not pushed or exported, and the service
// does not run git on a checkout the agent controls (its config can make
// git run commands: core.fsmonitor, filters) — and is reported as kept.
// Each removal is an rmdir, so a file that appears meanwhile keeps the
// directory. The caller verifies that no wrapper of the key runs.
func (p *Provider) RecoverKey(_ context.Context, sandboxID, runtimeKey, workspace string, shared bool) (provider.KeyRecovery, error) {
	var rec provider.KeyRecovery
	if err := validSandboxID(sandboxID); err != nil {
		return rec, err
	}
	home := p.HomeDir(sandboxID, runtimeKey)
	switch removed, err := removeIfOnly(home, workspaceRecord); {
	case err != nil:
		return rec, err
	case removed:
		rec.Removed = append(rec.Removed, "home")
	case exists(home):
		rec.KeptHome = true
	}
	if workspace == "" || shared {
		return rec, nil
	}
	ws := p.WorkspaceDir(sandboxID, workspace)
	switch removed, err := removeIfOnly(ws); {
	case err != nil:
		return rec, err
	case removed:
		rec.Removed = append(rec.Removed, "workspace")
	case exists(ws):
		rec.KeptWorkspace = true
	}
	return rec, nil
}

// removeIfOnly removes dir when it holds no entry but the named files
// (removed first), and reports whether it did. A directory that cannot be
// listed, holds anything else, or gains an entry before its rmdir is kept
// (false, nil): when unsure, keep. The error is only for a removal that
// failed otherwise.
func removeIfOnly(dir string, recreatable ...string) (bool, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false, nil // missing, or unreadable: nothing removed
	}
	if !onlyRecreatable(names(ents), recreatable) {
		return false, nil
	}
	for _, n := range recreatable {
		if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return false, err
		}
	}
	// Gone meanwhile, or not empty any more (ENOTEMPTY): kept.
	return os.Remove(dir) == nil, nil
}

// onlyRecreatable reports whether every entry is one of recreatable.
func onlyRecreatable(entries, recreatable []string) bool {
	for _, e := range entries {
		ok := false
		for _, r := range recreatable {
			ok = ok || e == r
		}
		if !ok {
			return false
		}
	}
	return true
}

func names(ents []os.DirEntry) []string {
	out := make([]string, len(ents))
	for i, e := range ents {
		out[i] = e.Name()
	}
	return out
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}
