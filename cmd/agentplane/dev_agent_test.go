package main

import (
	"bufio"
	"context"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/testenv"
)

// TestDevRunsARealAgent: `agentplane dev --agent opencode --provider-url URL
// --provider-key-file F` creates a session that runs the pinned opencode
// against the endpoint; a message makes it write a file, and the endpoint
// sees the key from the file. Under CI=true a missing agent is a failure.
func TestDevRunsARealAgent(t *testing.T) {
	agents, _ := filepath.Abs(filepath.Join("..", "..", "agents"))
	if _, err := os.Stat(filepath.Join(agents, "node_modules", "opencode-linux-x64", "bin", "opencode")); err != nil {
		testenv.Missing(t, "pinned opencode is not installed under %s (make agents)", agents)
	}
	bin := buildAgentplane(t)

	model := fakemodel.New()
	up := httptest.NewServer(model)
	defer up.Close()
	keyFile := filepath.Join(t.TempDir(), "key")
	require.NoError(t, os.WriteFile(keyFile, []byte("sk-dev-agent-key\n"), 0o600))
	root := t.TempDir()
	base := freePortBase(t)
	cmd := exec.Command(bin, "dev", "--sandbox-root", root, "--port-base", strconv.Itoa(base), "--drain-delay", "100ms",
		"--agent", "opencode", "--agents-dir", agents, "--model", "fake-model", "--provider-url", up.URL, "--provider-key-file", keyFile,
		"--pool", "opencode=1") // the README's flow with a pool; auto would start kilo too
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = t.Output()
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
		}
	})
	ids := make(chan string, 1)
	go func() {
		re := regexp.MustCompile(`session (\S+) runs agent opencode`)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			t.Log(sc.Text())
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				ids <- m[1]
			}
		}
	}()
	var id string
	select {
	case id = <-ids:
	case <-time.After(2 * time.Minute):
		t.Fatal("agentplane dev created no session")
	}

	conn := devConn(t, "127.0.0.1:"+strconv.Itoa(base), "127.0.0.1:"+strconv.Itoa(base))
	defer conn.Close()
	c := sessionv1.NewSessionServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	watch, err := c.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: id})
	require.NoError(t, err)
	_, err = c.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, MessageId: "m1", Content: "create hello.txt"})
	require.NoError(t, err)
	for {
		resp, err := watch.Recv()
		require.NoError(t, err)
		if o := resp.GetEvent().GetOutcome(); o != nil {
			require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
			break
		}
	}
	var found []string
	_ = filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err == nil && info.Name() == "hello.txt" {
			found = append(found, p)
		}
		return nil
	})
	require.Len(t, found, 1, "opencode wrote hello.txt")
	reqs := model.Requests()
	require.NotEmpty(t, reqs)
	for _, r := range reqs {
		require.Equal(t, "Bearer sk-dev-agent-key", r.Authorization, "the endpoint gets the key from the file")
	}
}
