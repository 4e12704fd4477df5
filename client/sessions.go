package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"iter"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// NewSessionID returns a fresh session id in the server's own format.
func NewSessionID() string { return "ses-" + randomHex(12) }

// NewMessageID returns a fresh message id.
func NewMessageID() string { return "msg-" + randomHex(12) }

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	return hex.EncodeToString(b)
}

// CreateSession stores a session. Without a session_id in req the client
// chooses one before the first attempt, so a retry after a lost response
// returns the stored session instead of creating a second one. req is not
// modified.
func (c *Client) CreateSession(ctx context.Context, req *sessionv1.CreateSessionRequest) (*sessionv1.Session, error) {
	if req.GetSessionId() == "" {
		req = proto.CloneOf(req)
		req.SessionId = NewSessionID()
	}
	resp, err := unary(ctx, c, "CreateSession", req, func(ctx context.Context, r *sessionv1.CreateSessionRequest) (*sessionv1.CreateSessionResponse, error) {
		return c.rpc.CreateSession(ctx, r)
	})
	return resp.GetSession(), err
}

// GetSession returns a session with its route view (also while it is being
// deleted: state DELETING).
func (c *Client) GetSession(ctx context.Context, req *sessionv1.GetSessionRequest) (*sessionv1.Session, error) {
	resp, err := unary(ctx, c, "GetSession", req, func(ctx context.Context, r *sessionv1.GetSessionRequest) (*sessionv1.GetSessionResponse, error) {
		return c.rpc.GetSession(ctx, r)
	})
	return resp.GetSession(), err
}

// ListSessions iterates over the sessions of req's organization (and user),
// newest first, fetching pages as it goes from req's page token on. An error
// ends the iteration.
func (c *Client) ListSessions(ctx context.Context, req *sessionv1.ListSessionsRequest) iter.Seq2[*sessionv1.Session, error] {
	return func(yield func(*sessionv1.Session, error) bool) {
		page := proto.CloneOf(req)
		for {
			resp, err := unary(ctx, c, "ListSessions", page, func(ctx context.Context, r *sessionv1.ListSessionsRequest) (*sessionv1.ListSessionsResponse, error) {
				return c.rpc.ListSessions(ctx, r)
			})
			if err != nil {
				yield(nil, err)
				return
			}
			for _, s := range resp.GetSessions() {
				if !yield(s, nil) {
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

// SendMessage queues a message. Without a message_id in req the client
// chooses one before the first attempt, so retries (the client's or the
// caller's with the returned id) deliver the message once. req is not
// modified; the returned message carries the id.
func (c *Client) SendMessage(ctx context.Context, req *sessionv1.SendMessageRequest) (*sessionv1.Message, error) {
	if req.GetMessageId() == "" {
		req = proto.CloneOf(req)
		req.MessageId = NewMessageID()
	}
	resp, err := unary(ctx, c, "SendMessage", req, func(ctx context.Context, r *sessionv1.SendMessageRequest) (*sessionv1.SendMessageResponse, error) {
		return c.rpc.SendMessage(ctx, r)
	})
	return resp.GetMessage(), err
}

// GetMessage returns one message with its state.
func (c *Client) GetMessage(ctx context.Context, req *sessionv1.GetMessageRequest) (*sessionv1.Message, error) {
	resp, err := unary(ctx, c, "GetMessage", req, func(ctx context.Context, r *sessionv1.GetMessageRequest) (*sessionv1.GetMessageResponse, error) {
		return c.rpc.GetMessage(ctx, r)
	})
	return resp.GetMessage(), err
}

// ListMessages iterates over a session's messages in queue order, fetching
// pages as it goes. An error ends the iteration.
func (c *Client) ListMessages(ctx context.Context, req *sessionv1.ListMessagesRequest) iter.Seq2[*sessionv1.Message, error] {
	return func(yield func(*sessionv1.Message, error) bool) {
		page := proto.CloneOf(req)
		for {
			resp, err := unary(ctx, c, "ListMessages", page, func(ctx context.Context, r *sessionv1.ListMessagesRequest) (*sessionv1.ListMessagesResponse, error) {
				return c.rpc.ListMessages(ctx, r)
			})
			if err != nil {
				yield(nil, err)
				return
			}
			for _, m := range resp.GetMessages() {
				if !yield(m, nil) {
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

// ExportHistory iterates over a session's whole history — the items of
// every runtime session the session had, in order — fetching pages as it
// goes. An error ends the iteration.
func (c *Client) ExportHistory(ctx context.Context, req *sessionv1.ExportHistoryRequest) iter.Seq2[*sessionv1.HistoryItem, error] {
	return func(yield func(*sessionv1.HistoryItem, error) bool) {
		page := proto.CloneOf(req)
		for {
			resp, err := unary(ctx, c, "ExportHistory", page, func(ctx context.Context, r *sessionv1.ExportHistoryRequest) (*sessionv1.ExportHistoryResponse, error) {
				return c.rpc.ExportHistory(ctx, r)
			})
			if err != nil {
				yield(nil, err)
				return
			}
			for _, it := range resp.GetItems() {
				if !yield(it, nil) {
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

// ListAuditRecords iterates over a session's audit records — every request
// the credential proxy forwarded for it and every egress decision of its
// runtime, each naming its turn — oldest first, fetching pages as it goes
// (req.TurnId: one turn's only). An error ends the iteration.
func (c *Client) ListAuditRecords(ctx context.Context, req *sessionv1.ListAuditRecordsRequest) iter.Seq2[*sessionv1.AuditRecord, error] {
	return func(yield func(*sessionv1.AuditRecord, error) bool) {
		page := proto.CloneOf(req)
		for {
			resp, err := unary(ctx, c, "ListAuditRecords", page, func(ctx context.Context, r *sessionv1.ListAuditRecordsRequest) (*sessionv1.ListAuditRecordsResponse, error) {
				return c.rpc.ListAuditRecords(ctx, r)
			})
			if err != nil {
				yield(nil, err)
				return
			}
			for _, r := range resp.GetRecords() {
				if !yield(r, nil) {
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

// CancelMessage cancels a queued or accepted message; a terminal message is
// returned unchanged.
func (c *Client) CancelMessage(ctx context.Context, req *sessionv1.CancelMessageRequest) (*sessionv1.Message, error) {
	resp, err := unary(ctx, c, "CancelMessage", req, func(ctx context.Context, r *sessionv1.CancelMessageRequest) (*sessionv1.CancelMessageResponse, error) {
		return c.rpc.CancelMessage(ctx, r)
	})
	return resp.GetMessage(), err
}

// StopSession cancels the session's queued and accepted work.
func (c *Client) StopSession(ctx context.Context, req *sessionv1.StopSessionRequest) (*sessionv1.Session, error) {
	resp, err := unary(ctx, c, "StopSession", req, func(ctx context.Context, r *sessionv1.StopSessionRequest) (*sessionv1.StopSessionResponse, error) {
		return c.rpc.StopSession(ctx, r)
	})
	return resp.GetSession(), err
}

// SuspendSession stops the session's runtime and returns once its
// processes are verified absent (the route is SUSPENDED). SUSPEND_PENDING
// carries RetryInfo, so it is called again within the retry policy.
func (c *Client) SuspendSession(ctx context.Context, req *sessionv1.SuspendSessionRequest) (*sessionv1.Session, error) {
	resp, err := unary(ctx, c, "SuspendSession", req, func(ctx context.Context, r *sessionv1.SuspendSessionRequest) (*sessionv1.SuspendSessionResponse, error) {
		return c.rpc.SuspendSession(ctx, r)
	})
	return resp.GetSession(), err
}

// ResumeSession starts the session's runtime again and returns once the
// route is READY.
func (c *Client) ResumeSession(ctx context.Context, req *sessionv1.ResumeSessionRequest) (*sessionv1.Session, error) {
	resp, err := unary(ctx, c, "ResumeSession", req, func(ctx context.Context, r *sessionv1.ResumeSessionRequest) (*sessionv1.ResumeSessionResponse, error) {
		return c.rpc.ResumeSession(ctx, r)
	})
	return resp.GetSession(), err
}

// DeleteSession deletes a session and returns once the deletion is
// complete. While the server answers DELETION_PENDING_CLEANUP (the absence
// of the session's processes is not verified yet) it calls again after the
// RetryInfo delay, for as long as ctx allows, and then returns that pending
// error (the server's reconciler carries on without the client). Other
// retryable errors are retried within the policy's attempts. A
// SESSION_NOT_FOUND after an attempt that reached the server means the
// deletion finished in between, and is success.
func (c *Client) DeleteSession(ctx context.Context, req *sessionv1.DeleteSessionRequest) error {
	reached := false
	failures, pending := 0, 0
	var lastPending error // what the caller is told if the deadline cuts a later call short
	for attempt := 1; ; attempt++ {
		_, err := c.rpc.DeleteSession(ctx, req)
		var delay time.Duration
		switch {
		case err == nil:
			return nil
		case reached && status.Code(err) == codes.NotFound && Reason(err) == ReasonSessionNotFound:
			return nil
		case ctx.Err() != nil:
			if lastPending != nil {
				return lastPending
			}
			return err
		case Reason(err) == ReasonDeletionPendingCleanup:
			reached = true
			pending++
			lastPending = err
			delay = c.retry.delay(err, pending)
		case Retryable(err):
			reached = true // the response may be what was lost
			failures++
			if failures >= c.retry.MaxAttempts {
				return err
			}
			delay = c.retry.delay(err, failures)
		default:
			return err
		}
		if !c.pause(ctx, Retry{Method: "DeleteSession", Attempt: attempt, Err: err, Delay: delay}) {
			return err
		}
	}
}
