package config

import (
	"context"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// isConnError is a failed dial, a broken or reset connection, or a socket
// timeout: the node may be gone.
func isConnError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// DefaultClusterReload is the slot map reload interval of a Cluster client
// (URL option cluster_reload_interval); go-redis' own default is 60s.
const DefaultClusterReload = 5 * time.Second

// reloadOnFailover makes a Cluster client reload its slot map as soon as a
// node stops answering or the cluster says it is failing over, instead of
// dialling the dead master until the periodic reload: go-redis reloads on
// MOVED only, and a dead master sends none. Reloads are asynchronous and
// go-redis coalesces them (one at a time, 200ms apart), so a burst of
// failing calls costs one CLUSTER SLOTS per cooldown.
type reloadOnFailover struct {
	cc      *redis.ClusterClient
	reloads atomic.Int64 // for tests
}

func (h *reloadOnFailover) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *reloadOnFailover) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.after(err)
		return err
	}
}

func (h *reloadOnFailover) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.after(err)
		return err
	}
}

func (h *reloadOnFailover) after(err error) {
	if err == nil || !(isConnError(err) || redis.IsClusterDownError(err) || redis.IsTryAgainError(err) ||
		redis.IsReadOnlyError(err) || redis.IsLoadingError(err)) {
		return
	}
	h.reloads.Add(1)
	h.cc.ReloadState(context.Background())
}
