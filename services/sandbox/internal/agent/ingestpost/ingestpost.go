// Package ingestpost writes history items through the credential proxy's
// ingest route (`<proxy>/ingest/v1/sessions/<runtime session>/items`,
// docs/credential.md) for the scripted runtime and the wrapper. Ingest
// applies an item only when its version is newer than the stored one, so a
// batch is idempotent by item id and version: a post that failed in transit
// (the proxy replica or the ingest replica behind it died, the balancer had
// no backend yet) is sent again with backoff until the caller's budget ends,
// instead of losing the turn's history.
package ingestpost

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"go.opentelemetry.io/otel/propagation"
)

// Backoff between attempts: doubling from firstBackoff up to maxBackoff,
// each wait jittered to 50–100 % so the writers of one sandbox do not retry
// in step. attemptTimeout bounds one attempt, so a hung connection leaves
// budget for another.
const (
	firstBackoff   = 100 * time.Millisecond
	maxBackoff     = 2 * time.Second
	attemptTimeout = 10 * time.Second
)

// Post sends body (a JSON batch of items) for runtime session rsid with
// handle as the bearer, continuing ctx's trace. It retries a transport
// error and a 502, 503 or 504 until ctx ends; any other answer is final.
// The error names the last failure, never the handle.
func Post(ctx context.Context, client *http.Client, proxy, handle, rsid string, body []byte) error {
	url := strings.TrimRight(proxy, "/") + "/ingest/v1/sessions/" + rsid + "/items"
	wait := firstBackoff
	for attempt := 1; ; attempt++ {
		again, err := post(ctx, client, url, handle, body)
		if !again {
			return err
		}
		sleep := wait/2 + rand.N(wait/2+1)
		if d, ok := ctx.Deadline(); ok && time.Until(d) < sleep {
			return fmt.Errorf("%w (gave up after %d attempts)", err, attempt)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (gave up after %d attempts)", err, attempt)
		case <-time.After(sleep):
		}
		wait = min(2*wait, maxBackoff)
	}
}

// retryable is a status the proxy or a balancer in front of it gives when
// the request may not have been applied and a later one can succeed.
func retryable(code int) bool {
	return code == http.StatusBadGateway || code == http.StatusServiceUnavailable || code == http.StatusGatewayTimeout
}

// post makes one attempt; again says whether its failure is worth another.
func post(ctx context.Context, client *http.Client, url, handle string, body []byte) (again bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, attemptTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return false, errors.New("bad proxy url")
	}
	req.Header.Set("Authorization", "Bearer "+handle)
	req.Header.Set("Content-Type", "application/json")
	propagation.TraceContext{}.Inject(ctx, propagation.HeaderCarrier(req.Header))
	resp, err := client.Do(req)
	if err != nil {
		return true, errors.New("proxy unreachable")
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return retryable(resp.StatusCode), fmt.Errorf("proxy answered %d", resp.StatusCode)
	}
	return false, nil
}
