package main

import (
	"bufio"
	"context"
	"flag"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the current output")

// replay is a SessionService that answers `agentplane run` with a recorded
// event stream (the `--output json` of a real run): the session, the message
// and then the recorded events, the outcome naming the message run sent.
type replay struct {
	sessionv1.UnimplementedSessionServiceServer
	events    []*sessionv1.SessionEvent
	messageID chan string
}

func (r *replay) CreateSession(_ context.Context, req *sessionv1.CreateSessionRequest) (*sessionv1.CreateSessionResponse, error) {
	return &sessionv1.CreateSessionResponse{Session: &sessionv1.Session{SessionId: "ses-golden", UserId: req.GetUserId(), OrgId: req.GetOrgId(),
		SandboxId: "sbx-golden", Worktree: req.GetWorktree(), State: sessionv1.SessionState_SESSION_STATE_ACTIVE}}, nil
}

func (r *replay) SendMessage(_ context.Context, req *sessionv1.SendMessageRequest) (*sessionv1.SendMessageResponse, error) {
	r.messageID <- req.GetMessageId()
	return &sessionv1.SendMessageResponse{Message: &sessionv1.Message{SessionId: req.GetSessionId(), MessageId: req.GetMessageId(),
		State: sessionv1.MessageState_MESSAGE_STATE_QUEUED}}, nil
}

func (r *replay) WatchSession(_ *sessionv1.WatchSessionRequest, stream sessionv1.SessionService_WatchSessionServer) error {
	id := <-r.messageID
	for _, ev := range r.events {
		ev = proto.Clone(ev).(*sessionv1.SessionEvent)
		if o := ev.GetOutcome(); o != nil {
			o.LastMessageId = id
		}
		if err := stream.Send(&sessionv1.WatchSessionResponse{Event: ev}); err != nil {
			return err
		}
	}
	<-stream.Context().Done()
	return nil
}

func readEvents(t *testing.T, path string) []*sessionv1.SessionEvent {
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var events []*sessionv1.SessionEvent
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		ev := &sessionv1.SessionEvent{}
		require.NoError(t, protojson.Unmarshal(sc.Bytes(), ev))
		events = append(events, ev)
	}
	require.NoError(t, sc.Err())
	return events
}

// elapsedTimes are the parts of the people's output that depend on the
// clock of the run.
var elapsedTimes = regexp.MustCompile(`\d+\.\ds\b`)

// TestRenderGolden (issue 36): `agentplane run` shows recorded event
// streams (a real opencode turn with its tool call updates, scripted turns
// with failing tools) for people exactly as testdata/*.golden has them: one
// line per tool call with its name, a short input and its status, the
// updates of one call merged, no ACP JSON; with --output json every event
// as it came. `go test -run TestRenderGolden -update` rewrites the files.
func TestRenderGolden(t *testing.T) {
	bin := builtWithVersion(t)
	streams, err := filepath.Glob(filepath.Join("testdata", "*.jsonl"))
	require.NoError(t, err)
	require.NotEmpty(t, streams)
	for _, stream := range streams {
		name := strings.TrimSuffix(filepath.Base(stream), ".jsonl")
		t.Run(name, func(t *testing.T) {
			events := readEvents(t, stream)
			run := func(args ...string) cliResult {
				srv := grpc.NewServer()
				sessionv1.RegisterSessionServiceServer(srv, &replay{events: events, messageID: make(chan string, 1)})
				l, err := net.Listen("tcp", "127.0.0.1:0")
				require.NoError(t, err)
				go func() { _ = srv.Serve(l) }()
				defer srv.Stop()
				return runBin(t, bin, append([]string{"run", "--addr", l.Addr().String(), "--dir", "/work/golden"}, args...)...)
			}

			r := run("the prompt")
			got := elapsedTimes.ReplaceAllString(r.stdout, "T")
			golden := filepath.Join("testdata", name+".golden")
			if *update {
				require.NoError(t, os.WriteFile(golden, []byte(got), 0o644))
			}
			want, err := os.ReadFile(golden)
			require.NoError(t, err)
			require.Equal(t, string(want), got, "stdout of agentplane run (stderr: %s)", r.stderr)
			require.NotContains(t, got, "acp_update", "no ACP JSON for people")
			require.NotContains(t, got, "{", "no JSON for people")

			r = run("--output", "json", "the prompt")
			var lines []string
			for l := range strings.Lines(r.stdout) {
				lines = append(lines, l)
			}
			require.Len(t, lines, len(events), "one line per event")
			for i, l := range lines {
				ev := &sessionv1.SessionEvent{}
				require.NoError(t, protojson.Unmarshal([]byte(l), ev))
				if o := ev.GetOutcome(); o != nil {
					o.LastMessageId = events[i].GetOutcome().GetLastMessageId()
				}
				require.True(t, proto.Equal(events[i], ev), "line %d is the recorded event, tool data and all", i)
			}
		})
	}
}
