package worktree

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/gittest"
)

// TestGitIgnoresTheAgentsConfig: the agent writes a .git/config with an
// fsmonitor, a hooks path full of hooks, clean/smudge/process filters, a
// required filter and a textconv driver, and a .gitattributes that names
// them, each program writing a marker when run. After the wrapper's
// Report (add -A, diff) and Push (add -A, diff, commit, push) no marker
// exists, and the files were committed as written (no filter touched
// them).
func TestGitIgnoresTheAgentsConfig(t *testing.T) {
	ctx := context.Background()
	g := gittest.Start(t, "tok-secret-2")
	g.CreateRepo(t, "org/app.git", map[string]string{"README.md": "hello\n"})
	proxy := fakeProxy(t, g.URL, g.Token)
	dir := filepath.Join(t.TempDir(), "ws")
	_, err := Prepare(ctx, spec(dir, g.RepoURL("org/app.git"), proxy), func(string, string) {})
	require.NoError(t, err)

	markers := t.TempDir()
	script := func(name string) string {
		p := filepath.Join(markers, name+".sh")
		body := fmt.Sprintf("#!/bin/sh\ntouch %s\ncat\n", filepath.Join(markers, name+".ran"))
		require.NoError(t, os.WriteFile(p, []byte(body), 0o755))
		return p
	}
	hooks := filepath.Join(dir, ".agent-hooks")
	require.NoError(t, os.MkdirAll(hooks, 0o755))
	for _, h := range []string{"pre-commit", "post-commit", "commit-msg", "pre-push", "post-index-change", "reference-transaction", "post-checkout"} {
		require.NoError(t, os.Link(script("hook-"+h), filepath.Join(hooks, h)))
	}
	cfg, err := os.OpenFile(filepath.Join(dir, ".git", "config"), os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = fmt.Fprintf(cfg, `[core]
	fsmonitor = %s
	hooksPath = %s
	untrackedCache = true
[filter "agentX"]
	clean = %s
	smudge = %s
	required = true
[filter "proc"]
	process = %s
[diff "conv"]
	textconv = %s
	command = %s
[credential]
	helper = %s
`, script("fsmonitor"), hooks, script("clean"), script("smudge"), script("process"), script("textconv"), script("extdiff"), script("credhelper"))
	require.NoError(t, err)
	require.NoError(t, cfg.Close())
	require.NoError(t, os.WriteFile(filepath.Join(dir, ".gitattributes"),
		[]byte("*.txt filter=agentX diff=conv\n*.md filter=proc diff=conv\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "a.txt"), []byte("agent text\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "README.md"), []byte("changed\n"), 0o644))

	noMarker := func(after string) {
		ran, err := filepath.Glob(filepath.Join(markers, "*.ran"))
		require.NoError(t, err)
		require.Empty(t, ran, "no program the agent's config names ran during %s", after)
	}
	ch, err := Report(ctx, dir, 1<<20)
	require.NoError(t, err)
	noMarker("Report")
	require.Contains(t, ch.Diff, "+agent text", "the diff is of the file, not a textconv of it")
	res, err := Push(ctx, PushSpec{Dir: dir, RepoURL: g.RepoURL("org/app.git"), ProxyURL: proxy,
		Handle: func() string { return testHandle }, Branch: "agent/safe", Message: "agent change"})
	require.NoError(t, err)
	require.True(t, res.Committed)

	noMarker("Push")
	bare := filepath.Join(g.Root, "org/app.git")
	require.Equal(t, "agent text\n", gittest.Run(t, bare, "show", "refs/heads/agent/safe:a.txt"), "committed as written")
	require.Equal(t, "changed\n", gittest.Run(t, bare, "show", "refs/heads/agent/safe:README.md"))
	require.True(t, strings.HasPrefix(res.Commit, strings.TrimSpace(gittest.Run(t, bare, "rev-parse", "refs/heads/agent/safe"))[:7]))
}
