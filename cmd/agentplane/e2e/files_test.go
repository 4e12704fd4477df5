package e2e

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"

	"agentplane.dev/client"
	"agentplane.dev/pkg/apierr/apierrtest"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// TestWorktreeFiles (issue 36 item 3): the client lists and reads the files
// the scripted runtime made, through the wrapper inside the boundary, in
// pages and ranges; traversal and oversized requests are refused at the
// door, symlinks leading out of the worktree by the wrapper, each with its
// reason, while a symlink inside the worktree is followed.
func TestWorktreeFiles(t *testing.T) {
	s := startSuite(t)
	c, err := client.Dial(s.sesAddr, client.WithToken(token))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	sess := s.create(t, "sbx-files", "/work/e2e-files", newSecret())
	id := sess.GetSessionId()
	ctx := context.Background()

	s.turn(t, id, "m1", "write: a.txt hello files")
	s.turn(t, id, "m2", "write: links.sh mkdir -p sub && cp a.txt sub/b.txt && ln -s a.txt in && ln -s /etc/hostname abs && ln -s ../.. up && truncate -s 1572864 big.bin")
	s.turn(t, id, "m3", "run: sh links.sh")

	// Pages of two: the client fetches them all, sorted by name.
	var names []string
	kinds := map[string]runtimev1.WorktreeFileType{}
	for f, err := range c.ListWorktreeFiles(ctx, &sessionv1.ListWorktreeFilesRequest{SessionId: id, PageSize: 2}) {
		require.NoError(t, err)
		names = append(names, f.GetName())
		kinds[f.GetName()] = f.GetType()
	}
	require.Equal(t, []string{"a.txt", "abs", "big.bin", "in", "links.sh", "sub", "up"}, names)
	require.Equal(t, runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_FILE, kinds["a.txt"])
	require.Equal(t, runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_DIRECTORY, kinds["sub"])
	require.Equal(t, runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_SYMLINK, kinds["up"])

	resp, err := c.ReadWorktreeFile(ctx, &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "sub/b.txt"})
	require.NoError(t, err)
	require.Equal(t, "hello files\n", string(resp.GetData()))
	require.EqualValues(t, 12, resp.GetSize())
	resp, err = c.ReadWorktreeFile(ctx, &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "a.txt", Offset: 6, Length: 5})
	require.NoError(t, err)
	require.Equal(t, "files", string(resp.GetData()))
	resp, err = c.ReadWorktreeFile(ctx, &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "in"})
	require.NoError(t, err)
	require.Equal(t, "hello files\n", string(resp.GetData()), "a symlink inside the worktree is followed")

	// A file over one range's bound comes whole in ranges.
	var big bytes.Buffer
	n, err := c.CopyWorktreeFile(ctx, id, "big.bin", &big)
	require.NoError(t, err)
	require.EqualValues(t, 1572864, n)
	require.Equal(t, make([]byte, 1572864), big.Bytes())
	resp, err = c.ReadWorktreeFile(ctx, &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "big.bin"})
	require.NoError(t, err)
	require.Len(t, resp.GetData(), 1<<20, "one range is at most 1 MiB")

	for _, tc := range []struct {
		name   string
		req    *sessionv1.ReadWorktreeFileRequest
		code   codes.Code
		reason string
	}{
		{"dot-dot", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "../e2e-files/a.txt"}, codes.InvalidArgument, "INVALID_REQUEST"},
		{"inner dot-dot", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "sub/../../etc/hostname"}, codes.InvalidArgument, "INVALID_REQUEST"},
		{"absolute", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "/etc/hostname"}, codes.InvalidArgument, "INVALID_REQUEST"},
		{"oversized", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "big.bin", Length: 2 << 20}, codes.InvalidArgument, "INVALID_REQUEST"},
		{"absolute symlink", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "abs"}, codes.FailedPrecondition, "PATH_ESCAPES_WORKTREE"},
		{"symlink out", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "up/etc/hostname"}, codes.FailedPrecondition, "PATH_ESCAPES_WORKTREE"},
		{"missing", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "nope.txt"}, codes.NotFound, "FILE_NOT_FOUND"},
		{"directory", &sessionv1.ReadWorktreeFileRequest{SessionId: id, Path: "sub"}, codes.FailedPrecondition, "NOT_A_REGULAR_FILE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := c.ReadWorktreeFile(ctx, tc.req)
			apierrtest.RequireStatus(t, err, tc.code, tc.reason)
			require.Empty(t, resp.GetData())
		})
	}
	_, err = c.Raw().ListWorktreeFiles(ctx, &sessionv1.ListWorktreeFilesRequest{SessionId: id, Path: "up"})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "PATH_ESCAPES_WORKTREE")
	_, err = c.Raw().ListWorktreeFiles(ctx, &sessionv1.ListWorktreeFilesRequest{SessionId: id, Path: "a.txt"})
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "NOT_A_DIRECTORY")
	_, err = c.Raw().ListWorktreeFiles(ctx, &sessionv1.ListWorktreeFilesRequest{SessionId: id, PageSize: 1001})
	apierrtest.RequireStatus(t, err, codes.InvalidArgument, "INVALID_REQUEST")
}

// TestWorktreeFilesWrite (issue 36 item 3): the client writes a batch (a new
// file in new directories, a replaced one, a mode) that the runtime and a
// read then see; a symlink out of the worktree, traversal and an oversized
// batch are refused with their reasons; while a turn runs a write is
// TURN_RUNNING unless forced.
func TestWorktreeFilesWrite(t *testing.T) {
	s := startSuite(t)
	c, err := client.Dial(s.sesAddr, client.WithToken(token))
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	id := s.create(t, "sbx-files-w", "/work/e2e-files-w", newSecret()).GetSessionId()
	ctx := context.Background()
	s.turn(t, id, "m1", "write: a.txt from the agent")
	s.turn(t, id, "m2", "run: ln -s /etc/hostname abs")

	resp, err := c.WriteWorktreeFiles(ctx, &sessionv1.WriteWorktreeFilesRequest{SessionId: id, Files: []*runtimev1.WorktreeFileWrite{
		{Path: "a.txt", Data: []byte("from the caller\n")},
		{Path: "tools/bin/run.sh", Data: []byte("#!/bin/sh\necho ran\n"), Mode: 0o755},
	}})
	require.NoError(t, err)
	require.EqualValues(t, 2, resp.GetFilesWritten())
	require.EqualValues(t, 16+19, resp.GetBytesWritten())
	var got bytes.Buffer
	_, err = c.CopyWorktreeFile(ctx, id, "a.txt", &got)
	require.NoError(t, err)
	require.Equal(t, "from the caller\n", got.String())
	var mode uint32
	for f, err := range c.ListWorktreeFiles(ctx, &sessionv1.ListWorktreeFilesRequest{SessionId: id, Path: "tools/bin"}) {
		require.NoError(t, err)
		mode = f.GetMode()
	}
	require.EqualValues(t, 0o755, mode)
	var out string
	for _, re := range runtimeEvents(s.turn(t, id, "m3", "run: sh tools/bin/run.sh"), "m3")[runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT] {
		if re.GetToolName() == "run_command" {
			out = re.GetData().GetFields()["output"].GetStringValue()
		}
	}
	require.Equal(t, "ran\n", out, "the runtime runs what the caller wrote")

	for _, tc := range []struct {
		name   string
		files  []*runtimev1.WorktreeFileWrite
		code   codes.Code
		reason string
	}{
		{"symlink out", []*runtimev1.WorktreeFileWrite{{Path: "abs", Data: []byte("x")}}, codes.FailedPrecondition, "PATH_ESCAPES_WORKTREE"},
		{"dot-dot", []*runtimev1.WorktreeFileWrite{{Path: "../x", Data: []byte("x")}}, codes.InvalidArgument, "INVALID_REQUEST"},
		{"oversized", []*runtimev1.WorktreeFileWrite{{Path: "a", Data: make([]byte, 2<<20)}, {Path: "b", Data: make([]byte, 2<<20)}}, codes.InvalidArgument, "INVALID_REQUEST"},
		{"too many", make([]*runtimev1.WorktreeFileWrite, 101), codes.InvalidArgument, "INVALID_REQUEST"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.WriteWorktreeFiles(ctx, &sessionv1.WriteWorktreeFilesRequest{SessionId: id, Files: tc.files})
			apierrtest.RequireStatus(t, err, tc.code, tc.reason)
		})
	}

	// A running turn: refused unless forced.
	_, err = s.ses.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, MessageId: "m-slow", Content: "slow: take a while"})
	require.NoError(t, err)
	write := &sessionv1.WriteWorktreeFilesRequest{SessionId: id, Files: []*runtimev1.WorktreeFileWrite{{Path: "b.txt", Data: []byte("b")}}}
	_, err = c.WriteWorktreeFiles(ctx, write)
	apierrtest.RequireStatus(t, err, codes.FailedPrecondition, "TURN_RUNNING")
	write.Force = true
	_, err = c.WriteWorktreeFiles(ctx, write)
	require.NoError(t, err)
	_, err = s.ses.StopSession(ctx, &sessionv1.StopSessionRequest{SessionId: id})
	require.NoError(t, err)
}
