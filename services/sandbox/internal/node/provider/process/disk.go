package process

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Workspaces lists the sandbox's workspace names (workspaces/ and homes/
// together) with the newer mtime of the two directories. A name whose mtime
// cannot be read carries ModTimeErr.
func (p *Provider) Workspaces(_ context.Context, sandboxID string) ([]provider.WorkspaceDir, error) {
	if err := validSandboxID(sandboxID); err != nil {
		return nil, err
	}
	byName := map[string]*provider.WorkspaceDir{}
	var order []string
	for _, sub := range []string{"workspaces", "homes"} {
		dir := filepath.Join(p.SandboxDir(sandboxID), sub)
		ents, err := os.ReadDir(dir)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", sub, err)
		}
		for _, e := range ents {
			w, ok := byName[e.Name()]
			if !ok {
				w = &provider.WorkspaceDir{Name: e.Name()}
				byName[e.Name()] = w
				order = append(order, e.Name())
			}
			info, err := os.Lstat(filepath.Join(dir, e.Name()))
			switch {
			case err != nil:
				w.ModTimeErr = err
			case info.ModTime().After(w.ModTime):
				w.ModTime = info.ModTime()
			}
		}
	}
	out := make([]provider.WorkspaceDir, 0, len(order))
	for _, n := range order {
		out = append(out, *byName[n])
	}
	return out, nil
}

// LiveWorkspaces returns the names of workspaces and homes in use by a
// live process of the sandbox (a per-session home has a name of its own). A
// failed listing, or a sandbox process that does not say which workspace it
// serves, is an error: the caller then cleans nothing.
func (p *Provider) LiveWorkspaces(_ context.Context, sandboxID string) (map[string]bool, error) {
	us, err := p.units(sandboxID)
	if err != nil {
		return nil, err
	}
	live := map[string]bool{}
	for _, u := range us {
		ws := u.anchor.vars[EnvWorkspace]
		if ws == "" {
			return nil, fmt.Errorf("pid %d of the sandbox names no workspace", u.anchor.pid)
		}
		live[ws] = true
		if home := u.anchor.vars["HOME"]; home != "" {
			live[filepath.Base(home)] = true
		}
	}
	return live, nil
}

// RemoveWorkspace removes a workspace and its home by name.
func (p *Provider) RemoveWorkspace(_ context.Context, sandboxID, name string) error {
	if err := validSandboxID(sandboxID); err != nil {
		return err
	}
	if name == "" || name == "." || name == ".." || filepath.Base(name) != name {
		return fmt.Errorf("process provider: invalid workspace name %q", name)
	}
	return p.removeWorkspace(sandboxID, name)
}
