package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

func testEnv(vars map[string]string) (*env, *bytes.Buffer, *bytes.Buffer) {
	var out, errb bytes.Buffer
	return &env{name: "agentplane test", stdout: &out, stderr: &errb, lookup: func(k string) (string, bool) {
		v, ok := vars[k]
		return v, ok
	}}, &out, &errb
}

func TestParseTakesFlagsAnywhere(t *testing.T) {
	for _, tc := range []struct {
		args []string
		dir  string
		pos  []string
	}{
		{[]string{"--dir", "/a", "hello"}, "/a", []string{"hello"}},
		{[]string{"hello", "--dir", "/a"}, "/a", []string{"hello"}},
		{[]string{"--", "--dir", "/a"}, "", []string{"--dir", "/a"}},
		{[]string{"id", "--dir=/b", "text"}, "/b", []string{"id", "text"}},
	} {
		e, _, _ := testEnv(nil)
		fs := e.flags("")
		dir := fs.String("dir", "", "")
		pos, _, ok := e.parse(fs, tc.args, -1)
		require.True(t, ok, "%v", tc.args)
		require.Equal(t, tc.pos, pos, "%v", tc.args)
		require.Equal(t, tc.dir, *dir, "%v", tc.args)
	}
}

func TestAddrComesFromTheFlagThenTheEnvironment(t *testing.T) {
	e, _, _ := testEnv(map[string]string{"AGENTPLANE_ADDR": "10.0.0.1:7401"})
	fs := e.flags("")
	_, _, ok := e.parse(fs, nil, 0)
	require.True(t, ok)
	require.Equal(t, "10.0.0.1:7401", e.addr)
	e, _, _ = testEnv(map[string]string{"AGENTPLANE_ADDR": "10.0.0.1:7401"})
	fs = e.flags("")
	_, _, ok = e.parse(fs, []string{"--addr", "10.0.0.2:1"}, 0)
	require.True(t, ok)
	require.Equal(t, "10.0.0.2:1", e.addr)
	e, _, _ = testEnv(nil)
	fs = e.flags("")
	_, _, ok = e.parse(fs, nil, 0)
	require.True(t, ok)
	require.Equal(t, "127.0.0.1:7401", e.addr, "agentplane dev's address")
}

// FuzzParse: whatever the arguments, parse never panics, reports at most
// one line on stderr, and its positional arguments are the input's, in
// order.
func FuzzParse(f *testing.F) {
	for _, seed := range []string{"--dir\x00/a\x00hello", "hello\x00--output\x00json", "--\x00-x", "-h", "--bogus", "--output\x00yaml", "", "\x00\x00--dir"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, joined string) {
		args := strings.Split(joined, "\x00")
		e, _, errb := testEnv(nil)
		fs := e.flags("")
		fs.String("dir", "", "")
		pos, code, ok := e.parse(fs, args, -1)
		if !ok {
			require.Contains(t, []int{exitOK, exitUsage}, code)
			require.LessOrEqual(t, strings.Count(errb.String(), "\n"), 1)
			return
		}
		i := 0
		for _, p := range pos { // a subsequence of args
			for i < len(args) && args[i] != p {
				i++
			}
			require.Less(t, i, len(args), "positional %q is not an argument", p)
			i++
		}
	})
}

func TestDescribeErrors(t *testing.T) {
	e, _, _ := testEnv(nil)
	e.addr = "127.0.0.1:1"
	for _, tc := range []struct {
		err  error
		want string
	}{
		{apierr.Error(codes.NotFound, "SESSION_NOT_FOUND", "session not found", apierr.FieldViolation("session_id", "no such session")),
			"session not found (session_id: no such session) [SESSION_NOT_FOUND]"},
		{apierr.Error(codes.FailedPrecondition, "DELETION_PENDING_CLEANUP", "cleanup pending", apierr.Metadata("pending_step", "verify_absence")),
			"cleanup pending (pending: verify_absence) [DELETION_PENDING_CLEANUP]"},
		{status.Error(codes.Unavailable, `connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:1: connect: connection refused"`),
			"cannot reach the session service at 127.0.0.1:1 (is `agentplane dev` running? --addr or AGENTPLANE_ADDR sets the address): connection refused"},
		{status.Error(codes.PermissionDenied, "no\nway"), "PermissionDenied: no way"},
		{apierr.Error(codes.InvalidArgument, "INVALID_REQUEST", "invalid worktree.repo_url: an http(s) repository URL",
			apierr.FieldViolation("worktree.repo_url", "an http(s) repository URL")),
			"invalid worktree.repo_url: an http(s) repository URL [INVALID_REQUEST]"},
	} {
		require.Equal(t, tc.want, e.describe(tc.err))
	}
}

func runtimeEvent(kind runtimev1.RuntimeEventKind, text, tool string, data map[string]any) *sessionv1.SessionEvent {
	var d *structpb.Struct
	if data != nil {
		d, _ = structpb.NewStruct(data)
	}
	return &sessionv1.SessionEvent{Kind: &sessionv1.SessionEvent_RuntimeEvent{RuntimeEvent: &runtimev1.RuntimeEvent{
		Kind: kind, Text: text, ToolName: tool, Data: d, MessageId: "m1"}}}
}

// Off a terminal: plain lines, each written once, no escape codes.
func TestHumanOutputOffATerminal(t *testing.T) {
	var out bytes.Buffer
	h := newHuman(&out, time.Now())
	for _, ev := range []*sessionv1.SessionEvent{
		{Kind: &sessionv1.SessionEvent_Route{Route: &sessionv1.RouteView{State: sessionv1.RouteState_ROUTE_STATE_PREPARING, Step: "start_wrapper"}}},
		{Kind: &sessionv1.SessionEvent_Progress{Progress: &runtimev1.ProgressStep{Step: "start_wrapper", Detail: "starting the wrapper"}}},
		{Kind: &sessionv1.SessionEvent_Route{Route: &sessionv1.RouteView{State: sessionv1.RouteState_ROUTE_STATE_READY}}},
		runtimeEvent(runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_STATUS, "busy", "", nil),
		runtimeEvent(runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_CALL, "", "list_files", map[string]any{"path": "."}),
		runtimeEvent(runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT, "", "list_files", map[string]any{"entries": 3}),
		runtimeEvent(runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA, "Hello, ", "", nil),
		runtimeEvent(runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA, "world", "", nil),
		runtimeEvent(runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE, "Hello, world", "", nil),
		runtimeEvent(runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE, "A message without deltas", "", nil),
		{Kind: &sessionv1.SessionEvent_Outcome{Outcome: &runtimev1.TurnOutcome{Result: runtimev1.TurnResult_TURN_RESULT_FAILED, FailureReason: "tool_error", Summary: "it broke"}}},
	} {
		h.Event(ev)
	}
	h.Close()
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	for i := range lines {
		lines[i] = elapsedRE.ReplaceAllString(lines[i], "(T)")
	}
	require.Equal(t, []string{
		"preparing: start_wrapper — starting the wrapper (T)",
		"ready after (T)",
		"working (T)",
		`→ list_files . · done`,
		"Hello, world",
		"A message without deltas",
		"✗ failed: tool_error — it broke (T)",
	}, lines)
	require.NotContains(t, out.String(), "\x1b")
}

func TestSettled(t *testing.T) {
	msg := func(id string, st sessionv1.MessageState) *sessionv1.SessionEvent {
		return &sessionv1.SessionEvent{Kind: &sessionv1.SessionEvent_Message{Message: &sessionv1.Message{MessageId: id, State: st}}}
	}
	outcome := func(id string, r runtimev1.TurnResult) *sessionv1.SessionEvent {
		return &sessionv1.SessionEvent{Kind: &sessionv1.SessionEvent_Outcome{Outcome: &runtimev1.TurnOutcome{LastMessageId: id, Result: r}}}
	}
	for _, tc := range []struct {
		ev   *sessionv1.SessionEvent
		want sessionv1.MessageState
		done bool
	}{
		{outcome("m1", runtimev1.TurnResult_TURN_RESULT_SUCCEEDED), sessionv1.MessageState_MESSAGE_STATE_COMPLETED, true},
		{outcome("m1", runtimev1.TurnResult_TURN_RESULT_FAILED), sessionv1.MessageState_MESSAGE_STATE_FAILED, true},
		{outcome("m1", runtimev1.TurnResult_TURN_RESULT_CANCELLED), sessionv1.MessageState_MESSAGE_STATE_CANCELLED, true},
		{outcome("m0", runtimev1.TurnResult_TURN_RESULT_SUCCEEDED), 0, false},
		{msg("m1", sessionv1.MessageState_MESSAGE_STATE_ACCEPTED), 0, false},
		{msg("m1", sessionv1.MessageState_MESSAGE_STATE_FAILED), sessionv1.MessageState_MESSAGE_STATE_FAILED, true},
		{msg("m1", sessionv1.MessageState_MESSAGE_STATE_CANCELLED), sessionv1.MessageState_MESSAGE_STATE_CANCELLED, true},
		{msg("m2", sessionv1.MessageState_MESSAGE_STATE_COMPLETED), 0, false},
	} {
		st, done := settled(tc.ev, "m1")
		require.Equal(t, tc.done, done, "%v", tc.ev)
		require.Equal(t, tc.want, st, "%v", tc.ev)
	}
}

func TestHandles(t *testing.T) {
	require.True(t, Handles([]string{"run", "x"}))
	for _, v := range sessionVerbs {
		require.True(t, Handles([]string{"session", v.name}))
	}
	require.True(t, Handles([]string{"session"}), "a usage error, never the session service")
	require.True(t, Handles([]string{"session", "--grpc-addr", ":1"}), "a usage error, never the session service")
	require.True(t, Handles([]string{"session", "frob"}))
	require.False(t, Handles([]string{"dev"}))
	require.False(t, Handles([]string{"serve", "session"}))
}

func TestGitTokenFromTheFileThenTheEnvironment(t *testing.T) {
	file := filepath.Join(t.TempDir(), "tok")
	require.NoError(t, os.WriteFile(file, []byte("ghs_from_file\n"), 0o600))
	e, _, _ := testEnv(map[string]string{"AGENTPLANE_GIT_TOKEN": "ghs_from_env"})
	o := &sessionOptions{dir: "/repo", repo: "https://example.com/r.git", gitTokenFile: file, gitUser: "bot"}
	req, err := o.request(e)
	require.NoError(t, err)
	require.Equal(t, "ghs_from_file", req.GetGitCredential().GetToken(), "the file wins over the environment")
	require.Equal(t, "bot", req.GetGitCredential().GetUsername())
	o.gitTokenFile, o.gitUser = "", ""
	req, err = o.request(e)
	require.NoError(t, err)
	require.Equal(t, "ghs_from_env", req.GetGitCredential().GetToken())
	e, _, _ = testEnv(nil)
	req, err = o.request(e)
	require.NoError(t, err)
	require.Nil(t, req.GetGitCredential(), "no token: no git credential")
	o.gitTokenFile = filepath.Join(t.TempDir(), "missing")
	_, err = o.request(e)
	require.ErrorContains(t, err, "--git-token-file")

	// Without --repo: the environment's token is not sent (CreateSession would refuse a git
	// credential without a repository), a flag of it is a usage error.
	e, _, _ = testEnv(map[string]string{"AGENTPLANE_GIT_TOKEN": "ghs_from_env"})
	o = &sessionOptions{dir: "/repo"}
	req, err = o.request(e)
	require.NoError(t, err)
	require.Nil(t, req.GetGitCredential())
	for _, o := range []*sessionOptions{{dir: "/repo", gitTokenFile: file}, {dir: "/repo", gitUser: "bot"}, {dir: "/repo", gitPushPrefix: "x/"}} {
		_, err = o.request(e)
		require.ErrorContains(t, err, "needs --repo")
	}
}

func TestGitPushPrefixFlag(t *testing.T) {
	e, _, _ := testEnv(map[string]string{"AGENTPLANE_GIT_TOKEN": "ghs_from_env"})
	o := &sessionOptions{dir: "/repo", repo: "https://example.com/r.git", gitPushPrefix: "team/bot/"}
	req, err := o.request(e)
	require.NoError(t, err)
	require.Equal(t, "team/bot/", req.GetGitCredential().GetPushBranchPrefix(), "passed as given: the server checks it")
	e, _, _ = testEnv(nil)
	_, err = o.request(e)
	require.ErrorContains(t, err, "--git-push-prefix needs a token")
}

var elapsedRE = regexp.MustCompile(`\(?\d+\.\ds\)?`)

func TestEgressFlag(t *testing.T) {
	e := &env{lookup: func(string) (string, bool) { return "", false }}
	o := &sessionOptions{dir: "/repo", egress: "registry.npmjs.org,*.pypi.org:443,10.0.0.0/8"}
	req, err := o.request(e)
	require.NoError(t, err)
	require.Equal(t, "registry.npmjs.org", req.GetEgress().GetAllow()[0].GetHost())
	require.Equal(t, []uint32{443}, req.GetEgress().GetAllow()[1].GetPorts())
	require.Equal(t, []string{"10.0.0.0/8"}, req.GetEgress().GetPrivateNetworks())
	o.egress = "*"
	_, err = o.request(e)
	require.ErrorContains(t, err, "--egress")
}

func TestSuspendAfterFlag(t *testing.T) {
	e := &env{lookup: func(string) (string, bool) { return "", false }}
	o := &sessionOptions{dir: "/repo"}
	req, err := o.request(e)
	require.NoError(t, err)
	require.Nil(t, req.GetSuspendAfter(), "the server's default")
	o.suspendAfter = 30 * time.Second
	req, err = o.request(e)
	require.NoError(t, err)
	require.Equal(t, 30*time.Second, req.GetSuspendAfter().AsDuration())
}
