package worktree

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/gittest"
	"agentplane.dev/pkg/testenv"
)

// TestCloneENOSPC: a clone that fills its filesystem (a real 1 MiB tmpfs)
// fails with workspace_no_space — ENOSPC evidence for the sandbox service —
// and leaves nothing behind.
func TestCloneENOSPC(t *testing.T) {
	disk := filepath.Join(t.TempDir(), "disk")
	require.NoError(t, os.MkdirAll(disk, 0o755))
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk).CombinedOutput(); err != nil {
		testenv.Missing(t, "a tmpfs is needed for the ENOSPC test: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", disk).Run() })

	g := gittest.Start(t, "tok-enospc")
	bare := g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n"})
	work := t.TempDir()
	gittest.Run(t, "", "clone", "-q", bare, work)
	big := make([]byte, 3<<20)
	for i := range big {
		big[i] = byte(i*7919 + i/3)
	}
	require.NoError(t, os.WriteFile(filepath.Join(work, "blob.bin"), big, 0o644))
	gittest.Run(t, work, "add", "-A")
	gittest.Run(t, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "big")
	gittest.Run(t, work, "push", "-q", "origin", "main")

	dir := filepath.Join(disk, "ws")
	_, err := Prepare(context.Background(), spec(dir, g.RepoURL("org/app.git"), fakeProxy(t, g.URL, g.Token)), func(string, string) {})
	require.Error(t, err)
	require.Equal(t, ReasonNoSpace, AsFailure(err, "").Reason, "%v", err)
	entries, _ := os.ReadDir(dir)
	require.Empty(t, entries, "nothing half-cloned stays behind")
}
