// Package storeerr tells a state-store outage (Redis unreachable, closed,
// loading or failing over) from every other error, so that each service's
// error translator answers it as UNAVAILABLE STORE_UNAVAILABLE with RetryInfo
// rather than as an internal error.
package storeerr

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
)

// unavailableReplies are Redis error replies that mean "not now": the node
// loads its data, has no reachable master, is a read-only replica after a
// failover, or the cluster is reconfiguring. MOVED and ASK reach a caller
// only from a single Cluster node's client (a stream watcher's own
// connection, a per-master scan) whose slot map predates a failover: the
// retry finds the new master.
var unavailableReplies = []string{"LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "BUSY ", "MOVED ", "ASK "}

// Unavailable reports whether err says the store could not be reached or
// could not serve the call right now. A cancelled or expired context is not
// an outage (the caller gave up or its bound passed).
func Unavailable(err error) bool {
	if errors.Is(err, ErrNotReplicated) {
		return true
	}
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false // (context.DeadlineExceeded is a net.Error too)
	}
	if errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var reply redis.Error
	if errors.As(err, &reply) {
		msg := reply.Error()
		for _, p := range unavailableReplies {
			if strings.HasPrefix(msg, p) {
				return true
			}
		}
	}
	return false
}

// ErrNotReplicated is a write the store applied on its master but could not
// confirm on the configured number of replicas (pkg/replication): it may be
// lost in a failover, so it is not acknowledged. Retry: every acknowledged
// write is idempotent by its id.
var ErrNotReplicated = errors.New("the write was not confirmed on enough Redis replicas")
