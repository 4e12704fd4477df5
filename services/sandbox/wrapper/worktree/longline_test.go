package worktree

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Issue 33 item 9: git's stderr with a line over the scanner's 64 KiB
// buffer (a remote's message, a hook's output) stopped the progress reader;
// git then blocked on the full pipe until the clone's timeout, holding the
// directory's lock. A git on PATH prints a 100 KiB line, then progress,
// 200 KiB more and its error: the run ends when git does, with git's error kept.
func TestCloneProgressSurvivesALongStderrLine(t *testing.T) {
	bin := t.TempDir()
	script := `#!/bin/sh
head -c 102400 /dev/zero | tr '\0' x >&2
printf '\nReceiving objects:  50%% (1/2)\n' >&2
head -c 204800 /dev/zero | tr '\0' y >&2
printf '\nfatal: the remote hung up\n' >&2
exit 128
`
	require.NoError(t, os.WriteFile(filepath.Join(bin, "git"), []byte(script), 0o755))
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))

	// The bound only stops a hung test (old code: git never exits by itself).
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var steps []string
	tail, err := runProgress(ctx, t.TempDir(), func(step, detail string) { steps = append(steps, step+": "+detail) }, "clone", "x")
	require.NoError(t, ctx.Err(), "git ended by itself, not by the context")
	require.Error(t, err)
	require.Contains(t, tail, "fatal: the remote hung up")
	require.Less(t, len(tail), 64<<10, "the tail stays bounded")
	require.Equal(t, []string{"clone: receiving objects 50%"}, steps, "progress after the long line is still read")
}
