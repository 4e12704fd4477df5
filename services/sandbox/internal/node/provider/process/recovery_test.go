package process

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Issue 33 item 6: recovery of a runtime key removes only what is
// verifiably recreatable; anything with a file in it stays, and a
// workspace another key uses is never touched.
func TestRecoverKeyRemovesOnlyWhatIsRecreatable(t *testing.T) {
	ctx := context.Background()
	p := plainProvider(t, nil)
	prep := func(dir, key string) {
		_, err := p.PrepareWorkspace(ctx, "sb", dir, key)
		require.NoError(t, err)
	}
	write := func(path string) { require.NoError(t, os.WriteFile(path, []byte("x"), 0o644)) }

	// Fresh and empty: both go.
	prep("/fresh", "/fresh")
	rec, err := p.RecoverKey(ctx, "sb", "/fresh", "/fresh", false)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"home", "workspace"}, rec.Removed)
	require.False(t, rec.KeptWorkspace)
	require.NoDirExists(t, p.WorkspaceDir("sb", "/fresh"))
	require.NoDirExists(t, p.HomeDir("sb", "/fresh"))

	// An uncommitted file, and a dot directory (a checkout's .git): kept.
	prep("/work", "/work")
	write(filepath.Join(p.WorkspaceDir("sb", "/work"), "notes.txt"))
	prep("/repo", "/repo")
	require.NoError(t, os.Mkdir(filepath.Join(p.WorkspaceDir("sb", "/repo"), ".git"), 0o755))
	for _, dir := range []string{"/work", "/repo"} {
		rec, err = p.RecoverKey(ctx, "sb", dir, dir, false)
		require.NoError(t, err)
		require.True(t, rec.KeptWorkspace, dir)
		require.DirExists(t, p.WorkspaceDir("sb", dir))
	}
	require.FileExists(t, filepath.Join(p.WorkspaceDir("sb", "/work"), "notes.txt"))

	// A home with the agent's state in it: kept.
	prep("/agent", "/agent")
	write(filepath.Join(p.HomeDir("sb", "/agent"), ".history"))
	rec, err = p.RecoverKey(ctx, "sb", "/agent", "/agent", false)
	require.NoError(t, err)
	require.True(t, rec.KeptHome)
	require.Equal(t, []string{"workspace"}, rec.Removed)
	require.FileExists(t, filepath.Join(p.HomeDir("sb", "/agent"), ".history"))

	// per_session: the key's own home goes, the directory's workspace (empty,
	// but another key uses it) stays.
	prep("/shared", "ses-1")
	prep("/shared", "ses-2")
	rec, err = p.RecoverKey(ctx, "sb", "ses-1", "/shared", true)
	require.NoError(t, err)
	require.Equal(t, []string{"home"}, rec.Removed)
	require.DirExists(t, p.WorkspaceDir("sb", "/shared"))
	require.DirExists(t, p.HomeDir("sb", "ses-2"), "another key's home is not touched")

	// Nothing there: nothing removed, nothing kept.
	rec, err = p.RecoverKey(ctx, "sb", "/none", "/none", false)
	require.NoError(t, err)
	require.Equal(t, provider.KeyRecovery{}, rec)
	require.Error(t, func() error { _, err := p.RecoverKey(ctx, "../x", "k", "/w", false); return err }())
}
