package client

import (
	"context"
	"io"
	"iter"

	"google.golang.org/protobuf/proto"

	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// ListWorktreeFiles iterates over the entries of a directory of the
// session's worktree, sorted by name, fetching pages as it goes. An error
// ends the iteration.
func (c *Client) ListWorktreeFiles(ctx context.Context, req *sessionv1.ListWorktreeFilesRequest) iter.Seq2[*runtimev1.WorktreeFile, error] {
	return func(yield func(*runtimev1.WorktreeFile, error) bool) {
		page := proto.CloneOf(req)
		for {
			resp, err := unary(ctx, c, "ListWorktreeFiles", page, func(ctx context.Context, r *sessionv1.ListWorktreeFilesRequest) (*sessionv1.ListWorktreeFilesResponse, error) {
				return c.rpc.ListWorktreeFiles(ctx, r)
			})
			if err != nil {
				yield(nil, err)
				return
			}
			for _, f := range resp.GetFiles() {
				if !yield(f, nil) {
					return
				}
			}
			if resp.GetNextPageToken() == "" {
				return
			}
			page.PageToken = resp.GetNextPageToken()
		}
	}
}

// ReadWorktreeFile reads one range (at most 1 MiB) of a file of the
// session's worktree.
func (c *Client) ReadWorktreeFile(ctx context.Context, req *sessionv1.ReadWorktreeFileRequest) (*sessionv1.ReadWorktreeFileResponse, error) {
	return unary(ctx, c, "ReadWorktreeFile", req, func(ctx context.Context, r *sessionv1.ReadWorktreeFileRequest) (*sessionv1.ReadWorktreeFileResponse, error) {
		return c.rpc.ReadWorktreeFile(ctx, r)
	})
}

// CopyWorktreeFile writes a whole file of the session's worktree to w, one
// bounded range after another until a range reaches the size the server
// reported with it (or is empty). It returns the bytes written.
func (c *Client) CopyWorktreeFile(ctx context.Context, sessionID, path string, w io.Writer) (int64, error) {
	var off int64
	for {
		resp, err := c.ReadWorktreeFile(ctx, &sessionv1.ReadWorktreeFileRequest{SessionId: sessionID, Path: path, Offset: off})
		if err != nil {
			return off, err
		}
		n, err := w.Write(resp.GetData())
		off += int64(n)
		if err != nil {
			return off, err
		}
		if len(resp.GetData()) == 0 || off >= resp.GetSize() {
			return off, nil
		}
	}
}

// WriteWorktreeFiles writes a bounded batch of files (at most 100, 3 MiB of
// data in all) into the session's worktree, in order. While the session
// has queued or accepted work it answers TURN_RUNNING unless req.Force.
// Retrying writes the same content again, so it is retried as the other
// calls are.
func (c *Client) WriteWorktreeFiles(ctx context.Context, req *sessionv1.WriteWorktreeFilesRequest) (*sessionv1.WriteWorktreeFilesResponse, error) {
	return unary(ctx, c, "WriteWorktreeFiles", req, func(ctx context.Context, r *sessionv1.WriteWorktreeFilesRequest) (*sessionv1.WriteWorktreeFilesResponse, error) {
		return c.rpc.WriteWorktreeFiles(ctx, r)
	})
}
