package client

import (
	"context"
	"errors"
	"io"
	"iter"
	"time"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// Watch iterates over a session's events after cursor from ("" starts at
// the oldest retained event, "$" with new events only, a SessionEvent's
// cursor right after that event), in log order, until ctx ends or an error
// that a reconnect cannot fix.
//
// When the stream breaks (the session service restarts or sheds the
// connection: UNAVAILABLE, or an end of stream, which a watch never has
// otherwise) Watch opens it again after the last event it yielded, so no
// event is lost or repeated. It keeps trying for the policy's
// WatchReconnectWindow without an event, then yields the error. Errors end
// the iteration: SESSION_NOT_FOUND (unknown or deleted session), a bad
// cursor, or ctx's error.
//
// With from "$", events between a break before the first event and the
// reconnect are not seen: "$" means "new from now" on each open. Pass the
// cursor of an earlier event (or "") where that matters.
func (c *Client) Watch(ctx context.Context, sessionID, from string) iter.Seq2[*sessionv1.SessionEvent, error] {
	return func(yield func(*sessionv1.SessionEvent, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		cursor := from
		failures := 0
		var brokenSince time.Time
		for {
			err := c.watchOnce(ctx, sessionID, cursor, func(ev *sessionv1.SessionEvent) bool {
				failures = 0
				if ev.GetCursor() != "" {
					cursor = ev.GetCursor()
				}
				return yield(ev, nil)
			})
			if errors.Is(err, errStopped) {
				return
			}
			if cerr := ctxErr(ctx); cerr != nil {
				yield(nil, cerr)
				return
			}
			if !errors.Is(err, io.EOF) && !Retryable(err) {
				yield(nil, err)
				return
			}
			failures++
			if failures == 1 {
				brokenSince = c.clock.now()
			}
			if c.clock.now().Sub(brokenSince) > c.retry.WatchReconnectWindow {
				yield(nil, err)
				return
			}
			if !c.pause(ctx, Retry{Method: "WatchSession", Attempt: failures, Err: err, Delay: c.retry.delay(err, failures)}) {
				if cerr := ctxErr(ctx); cerr != nil {
					err = cerr
				}
				yield(nil, err)
				return
			}
		}
	}
}

var errStopped = errors.New("the caller stopped the iteration")

// ctxErr is ctx's error, also in the moment between its deadline passing
// and ctx noticing: a stream cut by the deadline may report first.
func ctxErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}

// watchOnce runs one stream from cursor until it ends; it returns its error
// (io.EOF when the server ended it) or errStopped when yield said stop.
func (c *Client) watchOnce(ctx context.Context, sessionID, cursor string, yield func(*sessionv1.SessionEvent) bool) error {
	stream, err := c.rpc.WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: sessionID, Cursor: cursor})
	if err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return err
		}
		if !yield(resp.GetEvent()) {
			return errStopped
		}
	}
}
