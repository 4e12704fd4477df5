package store

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// WatchConns gives each stream watcher a Redis connection of its own and
// closes that connection's socket the moment the watcher's context ends.
// go-redis applies context deadlines to the socket but not cancellation, so
// a watcher whose client went away would otherwise sit in XREAD BLOCK, and
// hold its connection, until the block timeout.
//
// At most size connections are open at once; a watcher waits for a free
// one as long as the client's pool timeout, like a pooled command would.
type WatchConns struct {
	rdb   redis.UniversalClient // where the nodes and their options come from
	slots chan struct{}
}

// NewWatchConns bounds watchers of rdb's streams to size connections.
func NewWatchConns(rdb redis.UniversalClient, size int) *WatchConns {
	return &WatchConns{rdb: rdb, slots: make(chan struct{}, size)}
}

// errWatchEnded is the dial error of a watch connection whose watcher ended.
var errWatchEnded = errors.New("watch connection closed: watcher ended")

// Open returns a connection that reads session id's events. It is torn down
// as soon as ctx ends (a blocked read then fails at once); the caller must
// still Close it to free its slot.
func (w *WatchConns) Open(ctx context.Context, id string) (*WatchConn, error) {
	opt, err := w.nodeOptions(ctx, key(id, "events"))
	if err != nil {
		return nil, err
	}
	wait := time.NewTimer(opt.PoolTimeout)
	defer wait.Stop()
	select {
	case w.slots <- struct{}{}:
	case <-wait.C:
		return nil, redis.ErrPoolTimeout
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	c := &WatchConn{key: key(id, "events"), slots: w.slots}
	dial := opt.Dialer
	opt.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
		nc, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return c.track(nc)
	}
	// One connection, never pooled beyond this watcher.
	opt.PoolSize, opt.MinIdleConns, opt.MaxIdleConns, opt.MaxActiveConns = 1, 0, 0, 0
	c.rdb = redis.NewClient(opt)
	c.stop = context.AfterFunc(ctx, c.interrupt)
	return c, nil
}

// nodeOptions are a copy of the options of the node that serves key.
func (w *WatchConns) nodeOptions(ctx context.Context, key string) (*redis.Options, error) {
	var node *redis.Client
	switch c := w.rdb.(type) {
	case *redis.Client: // one node or Sentinel (its Dialer finds the master)
		node = c
	case *redis.ClusterClient:
		n, err := c.MasterForKey(ctx, key)
		if err != nil {
			return nil, err
		}
		node = n
	default:
		return nil, fmt.Errorf("watch: unsupported Redis client %T", w.rdb)
	}
	opt := *node.Options()
	return &opt, nil
}

// WatchConn is one watcher's connection; one goroutine uses it.
type WatchConn struct {
	key   string
	rdb   *redis.Client
	slots chan struct{}
	stop  func() bool

	mu    sync.Mutex
	nc    net.Conn // the socket in use, if dialled
	ended bool     // interrupted or closed: no further dials
}

func (c *WatchConn) track(nc net.Conn) (net.Conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ended {
		_ = nc.Close()
		return nil, errWatchEnded
	}
	c.nc = nc
	return nc, nil
}

// interrupt closes the socket, failing a blocked read at once.
func (c *WatchConn) interrupt() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ended = true
	if c.nc != nil {
		_ = c.nc.Close()
	}
}

// Wait blocks up to block for events after cursor; none is (nil, nil).
// After the watcher's context ended it fails with a closed-connection
// error, which the caller tells apart by its context.
func (c *WatchConn) Wait(ctx context.Context, cursor string, n int64, block time.Duration) ([]StoredEvent, error) {
	res, err := c.rdb.XRead(ctx, &redis.XReadArgs{
		Streams: []string{c.key, cursor}, Count: n, Block: block,
	}).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil || len(res) == 0 {
		return nil, err
	}
	return decodeAll(res[0].Messages)
}

// Close releases the connection and its slot.
func (c *WatchConn) Close() {
	c.stop()
	c.interrupt()
	_ = c.rdb.Close()
	<-c.slots
}
