package client

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
)

// Reasons of docs/errors.md a caller of the SessionService branches on
// (read them with Reason).
const (
	ReasonInvalidRequest         = "INVALID_REQUEST"
	ReasonSessionNotFound        = "SESSION_NOT_FOUND"
	ReasonMessageNotFound        = "MESSAGE_NOT_FOUND"
	ReasonMessageIDConflict      = "MESSAGE_ID_CONFLICT"
	ReasonSessionIDConflict      = "SESSION_ID_CONFLICT"
	ReasonDeletionPendingCleanup = "DELETION_PENDING_CLEANUP"
	ReasonPeerUnavailable        = "PEER_UNAVAILABLE"
	ReasonSessionBusy            = "SESSION_BUSY"
)

// Reason returns the agentplane ErrorInfo reason carried by err ("" when
// none, e.g. a transport error).
func Reason(err error) string { return apierr.Reason(err) }

// RetryPolicy bounds the client's retries.
type RetryPolicy struct {
	// MaxAttempts is how many times one unary call is made, the first
	// included. DeleteSession's waits through a pending cleanup do not count:
	// they last as long as the context.
	MaxAttempts int
	// InitialBackoff and MaxBackoff bound the exponential, jittered wait
	// between attempts when the error carries no RetryInfo.
	InitialBackoff, MaxBackoff time.Duration
	// WatchReconnectWindow is how long Watch keeps reconnecting a broken
	// stream without receiving an event before it yields the error.
	WatchReconnectWindow time.Duration
}

// DefaultRetryPolicy: 6 attempts 100 ms to 5 s apart (about 3 s of waits,
// longer than ConnectBackoffMax); Watch reconnects for up to 2 minutes (a
// rolling restart of the session service).
var DefaultRetryPolicy = RetryPolicy{
	MaxAttempts: 6, InitialBackoff: 100 * time.Millisecond, MaxBackoff: 5 * time.Second,
	WatchReconnectWindow: 2 * time.Minute,
}

func (p RetryPolicy) validate() error {
	if p.MaxAttempts < 1 || p.InitialBackoff <= 0 || p.MaxBackoff < p.InitialBackoff || p.WatchReconnectWindow < 0 {
		return fmt.Errorf("%w: %+v (want MaxAttempts >= 1, 0 < InitialBackoff <= MaxBackoff, WatchReconnectWindow >= 0)", errBadPolicy, p)
	}
	return nil
}

// Retry describes one wait before a retry, for WithRetryHook.
type Retry struct {
	Method  string        // RPC name, e.g. "SendMessage"; "WatchSession" for a reconnect
	Attempt int           // the attempt that failed, from 1
	Err     error         // its error
	Delay   time.Duration // the wait before the next attempt
}

// Retryable reports whether err is worth a retry of an idempotent call
// (every SessionService call is one once its ids are set, which the client
// does): UNAVAILABLE (the service or a peer is down or moving:
// PEER_UNAVAILABLE, transport errors), SESSION_BUSY, and any error whose
// RetryInfo says when a retry may succeed.
func Retryable(err error) bool {
	if err == nil {
		return false
	}
	if _, ok := apierr.RetryDelay(err); ok {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable:
		return true
	case codes.Aborted:
		return Reason(err) == ReasonSessionBusy
	}
	return false
}

// delay is the wait after the attempt-th failure: the server's RetryInfo
// when it gave one, else exponential backoff with ±20% jitter.
func (p RetryPolicy) delay(err error, attempt int) time.Duration {
	if d, ok := apierr.RetryDelay(err); ok && d > 0 {
		return d
	}
	return p.backoff(attempt)
}

func (p RetryPolicy) backoff(attempt int) time.Duration {
	d := p.InitialBackoff
	for i := 1; i < attempt && d < p.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, p.MaxBackoff)
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// pause reports the retry to the hook and waits d. It returns false,
// without waiting, when ctx ends first or its deadline falls before the
// wait is over: an attempt that could not start in time is not made.
func (c *Client) pause(ctx context.Context, r Retry) bool {
	if dl, ok := ctx.Deadline(); ok && dl.Sub(c.clock.now()) < r.Delay {
		return false
	}
	if c.hook != nil {
		c.hook(r)
	}
	return c.clock.sleep(ctx, r.Delay)
}

// clock is the time the retry waits read; tests replace it to check the
// deadline rule by counting attempts, with no wall-clock relation.
type clock struct {
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) bool // false when ctx ended first
}

var wallClock = clock{now: time.Now, sleep: func(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}}

// unary makes one call with bounded retries. It returns the last error
// when a retry is not worth it, the attempts are used up or the context's
// deadline comes first.
func unary[Req, Resp any](ctx context.Context, c *Client, method string, req Req, call func(context.Context, Req) (Resp, error)) (Resp, error) {
	for attempt := 1; ; attempt++ {
		resp, err := call(ctx, req)
		if err == nil || ctx.Err() != nil || !Retryable(err) || attempt >= c.retry.MaxAttempts {
			return resp, err
		}
		if !c.pause(ctx, Retry{Method: method, Attempt: attempt, Err: err, Delay: c.retry.delay(err, attempt)}) {
			return resp, err
		}
	}
}
