package e2e

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protojson"

	"agentplane.dev/cmd/agentplane/internal/fakemodel"
	"agentplane.dev/pkg/apierr/apierrtest"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	sandbox "agentplane.dev/services/sandbox/server"
)

// innerHome is the runtime's HOME inside its sandbox (boundary.InnerHome).
const innerHome = "/agentplane/home"

// requireNoHostLayout fails when an event names the host's side of the
// sandbox (its root, a workspaces/ directory): the agent's tool calls, their
// results and the route speak the session's paths only.
func requireNoHostLayout(t *testing.T, root string, events []*sessionv1.SessionEvent) {
	t.Helper()
	for _, ev := range events {
		b, err := protojson.Marshal(ev)
		require.NoError(t, err)
		require.NotContains(t, string(b), root, "an event names the host's sandbox root")
		require.NotContains(t, string(b), "/workspaces/", "an event names a host workspace")
	}
}

// TestAgentWorksAtItsDirectory (issue 32 item 5): behind the real boundary,
// the scripted runtime of each session works at the session's directory:
// `pwd` prints it, `ls <directory>` lists what the agent wrote there, and the
// file lands in the session's workspace on the host. Two sessions of one
// sandbox with different directories each see their own workspace at their
// own path and not the other's; HOME is the home's own path inside. A
// directory the sandbox binds itself (here the wrapper binary's directory)
// fails the route directory_reserved; one CreateSession knows to be a system
// path is refused there (DIRECTORY_RESERVED).
func TestAgentWorksAtItsDirectory(t *testing.T) {
	s := startSuite(t)
	const dirA, dirB = "/work/e2e-dir/a", "/srv/e2e-dir/b"
	a := s.create(t, "sbx-dir", dirA, newSecret())
	b := s.create(t, "sbx-dir", dirB, newSecret())
	require.Equal(t, a.GetSandboxId(), b.GetSandboxId(), "one sandbox, two directories")

	require.Equal(t, dirA+"\n", runIn(t, s, a.GetSessionId(), "a-pwd", "pwd"), "pwd is the session's directory")
	require.Equal(t, dirB+"\n", runIn(t, s, b.GetSessionId(), "b-pwd", "pwd"))

	events := s.turn(t, a.GetSessionId(), "a-write", "write: hello.txt hi")
	var wrote *runtimev1.RuntimeEvent
	for _, re := range runtimeEvents(events, "a-write")[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT] {
		if re.GetToolName() == "write_file" {
			wrote = re
		}
	}
	require.NotNil(t, wrote, "the write_file result")
	require.Equal(t, "hello.txt", wrote.GetData().AsMap()["path"], "written: %v", wrote.GetData().AsMap())
	require.Equal(t, "hello.txt\n", runIn(t, s, a.GetSessionId(), "a-ls", "ls", dirA), "ls <directory> lists the agent's file")
	require.Contains(t, runIn(t, s, a.GetSessionId(), "a-abs", "cat", dirA+"/hello.txt"), "hi")
	require.Contains(t, runIn(t, s, b.GetSessionId(), "b-ls", "ls", dirA), "No such file or directory",
		"a session sees only its own workspace")
	files := findFile(t, s.root, "hello.txt")
	require.Len(t, files, 1)
	require.Equal(t, "workspaces", filepath.Base(filepath.Dir(filepath.Dir(files[0]))), "in the session's workspace on the host: %s", files[0])
	content, err := os.ReadFile(files[0])
	require.NoError(t, err)
	require.Equal(t, "hi\n", string(content))
	requireNoHostLayout(t, s.root, events)

	require.Equal(t, innerHome+"\n", runIn(t, s, a.GetSessionId(), "a-home", "printenv", "HOME"),
		"HOME is the home's own path inside, not the host's")

	c := s.create(t, "sbx-dir-reserved", filepath.Dir(wrapperBin), newSecret())
	route, message := s.failedRoute(t, c.GetSessionId())
	require.Equal(t, "directory_reserved", route)
	require.Equal(t, "route_failed", message)
	_, err = s.ses.CreateSession(context.Background(), &sessionv1.CreateSessionRequest{
		UserId: "u-e2e", OrgId: "o-e2e", SandboxId: "sbx-dir-proc-" + s.run, Worktree: &sessionv1.Worktree{Directory: "/proc/self"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
	})
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, "DIRECTORY_RESERVED")
}

// TestAgentCreatesAFileAtItsDirectory (issue 32 item 5): a real pinned agent
// asked to "create <directory>/hello.txt" — the session's absolute path —
// does so: the agent's working directory is the session's directory (its
// system prompt says so), its write tool completes, and the file lands in
// the session's workspace on the host. Neither the events nor anything the
// agent sends its model (its system prompt names its working directory and
// global config) name the host's layout.
func TestAgentCreatesAFileAtItsDirectory(t *testing.T) {
	forEachAgent(t, func(t *testing.T, agent string) {
		s := startACPSuite(t, agent, nil)
		dir := "/work/e2e-dir-" + agent + "/repo"
		sess := s.createAgent(t, "sbx-dir-"+agent, dir, newSecret(), agent)
		events, o := s.watchTurn(t, sess.GetSessionId(), "m1", "Please create "+dir+"/hello.txt", nil)
		require.Equal(t, runtimev1.TurnResult_TURN_RESULT_SUCCEEDED, o.GetResult(), "outcome %v", o)
		byKind := runtimeEvents(events, "m1")
		calls := byKind[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL]
		require.NotEmpty(t, calls, "the tool call")
		require.Equal(t, fakemodel.WriteTool, calls[0].GetToolName())
		results := byKind[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT]
		require.NotEmpty(t, results, "the tool result")
		require.Equal(t, "completed", results[len(results)-1].GetData().AsMap()["status"], "the write succeeded: %v", results)

		files := findFile(t, s.root, "hello.txt")
		require.Len(t, files, 1, "the agent wrote one hello.txt under the sandbox root")
		require.Equal(t, "workspaces", filepath.Base(filepath.Dir(filepath.Dir(files[0]))), "in the session's workspace: %s", files[0])
		b, err := os.ReadFile(files[0])
		require.NoError(t, err)
		require.Equal(t, fakemodel.FileContent, string(b))

		var workdirs []string
		for _, r := range s.model.Requests() {
			if r.WorkDir != "" {
				workdirs = append(workdirs, r.WorkDir)
			}
		}
		require.NotEmpty(t, workdirs, "the agent's system prompt names its working directory")
		for _, w := range workdirs {
			require.Equal(t, dir, w, "the agent works at the session's directory")
		}
		requireNoHostLayout(t, s.root, events)
		for _, r := range s.model.Requests() {
			require.NotContains(t, r.Prompt, s.root, "what the agent tells its model never names the host's sandbox root")
		}
	})
}

// TestResumedRuntimeWorksAtItsDirectory (issue 32 item 5): after an idle
// stop the next message launches the runtime again, and it is again at the
// session's directory, with what the first runtime wrote there.
func TestResumedRuntimeWorksAtItsDirectory(t *testing.T) {
	s := startSuiteWith(t, nil, func(c *sandbox.Config) { c.Timers.IdleStop = 2 * time.Second })
	const dir = "/home/e2e/resume"
	sess := s.create(t, "sbx-dir-resume", dir, newSecret())
	id := sess.GetSessionId()
	s.turn(t, id, "m1", "write: notes.txt before the stop")
	require.Equal(t, dir+"\n", runIn(t, s, id, "m2", "pwd"))
	first := s.routeView(t, id).GetWrapperInstance()
	require.Eventually(t, func() bool { return s.routeView(t, id).GetState() != sessionv1.RouteState_ROUTE_STATE_READY },
		2*time.Minute, 100*time.Millisecond, "the idle runtime is stopped")
	require.Equal(t, dir+"\n", runIn(t, s, id, "m3", "pwd"), "the resumed runtime works at the session's directory")
	require.Equal(t, "notes.txt\n", runIn(t, s, id, "m4", "ls", dir))
	require.NotEqual(t, first, s.routeView(t, id).GetWrapperInstance(), "a new wrapper")
}
