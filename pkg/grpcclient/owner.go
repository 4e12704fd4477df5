package grpcclient

import (
	"context"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"agentplane.dev/pkg/apierr"
)

// OwnerRouter sends calls about an entity that one replica owns (a sandbox)
// to that replica, for services whose replicas are not interchangeable.
//
// Installed as a unary interceptor on the connection to the service (any
// address form: one Service address, a list, dns:///), it keeps a pool of
// connections to the replicas it learned of. A call whose entity has a
// known owner goes straight to it; otherwise it goes through the
// connection's own balancing. When the replica asked answers with the
// router's reason and names the owner's address in ErrorInfo metadata
// (apierr.MetaOwnerAddr), the router remembers the owner and sends the
// call there once. So no call depends on a balancer happening to pick the
// owner, and a wrong pick costs one extra round trip.
type OwnerRouter struct {
	reason string
	key    func(req any) string
	dial   func(addr string) (*grpc.ClientConn, error)

	mu     sync.Mutex
	owners map[string]string // entity key → owner address
	pool   map[string]*grpc.ClientConn
}

// maxOwners bounds the remembered owners; past it the map starts over
// (a forgotten owner is learned again in one round trip).
const maxOwners = 100_000

// maxPool is the pool size past which unused owner connections close.
const maxPool = 64

// NewOwnerRouter routes calls by key(req) (the entity id; "" for calls
// about no entity) when a replica answers reason. Connections to owners
// are dialled like c's, with the same token and opts.
func NewOwnerRouter(c *Conns, reason string, key func(req any) string, opts ...grpc.DialOption) *OwnerRouter {
	return &OwnerRouter{
		reason: reason, key: key,
		dial:   func(addr string) (*grpc.ClientConn, error) { return c.Dial(addr, opts...) },
		owners: map[string]string{}, pool: map[string]*grpc.ClientConn{},
	}
}

// DialOption installs the router on a connection.
func (r *OwnerRouter) DialOption() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(r.intercept)
}

// Owner returns the owner address remembered for key ("" when none).
func (r *OwnerRouter) Owner(key string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.owners[key]
}

func (r *OwnerRouter) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	key := r.key(req)
	if key == "" {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	tried := r.Owner(key)
	var err error
	if tried != "" {
		err = r.invokeAt(ctx, tried, method, req, reply, opts...)
		if err == nil {
			return nil
		}
		if !r.movedOrGone(err) {
			return err
		}
		r.forget(key, tried)
		if next := r.named(err); next != "" && next != tried {
			r.remember(key, next)
			return r.invokeAt(ctx, next, method, req, reply, opts...)
		}
		if ctx.Err() != nil {
			return err // a paused owner used the call's budget; the next call asks the balancer
		}
	}
	// No owner known (or it moved without naming a successor): ask through
	// the connection's balancing, and follow a named owner once.
	err = invoker(ctx, method, req, reply, cc, opts...)
	if next := r.named(err); next != "" && next != tried {
		r.remember(key, next)
		return r.invokeAt(ctx, next, method, req, reply, opts...)
	}
	return err
}

// named is the owner address a reason error carries, or "".
func (r *OwnerRouter) named(err error) string {
	info := apierr.Info(err)
	if info.GetReason() != r.reason {
		return ""
	}
	return info.GetMetadata()[apierr.MetaOwnerAddr]
}

// movedOrGone reports an answer that says the remembered owner may no
// longer be the one to ask: it names another owner, or it did not answer
// at all (a replica that died, left or is paused: gRPC's own Unavailable
// or DeadlineExceeded, without an agentplane ErrorInfo).
func (r *OwnerRouter) movedOrGone(err error) bool {
	if apierr.Reason(err) == r.reason {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded:
		return apierr.Info(err) == nil
	}
	return false
}

func (r *OwnerRouter) invokeAt(ctx context.Context, addr, method string, req, reply any, opts ...grpc.CallOption) error {
	conn, err := r.conn(addr)
	if err != nil {
		return err
	}
	return conn.Invoke(ctx, method, req, reply, opts...)
}

func (r *OwnerRouter) conn(addr string) (*grpc.ClientConn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.pool[addr]; ok {
		return c, nil
	}
	c, err := r.dial(addr)
	if err != nil {
		return nil, err
	}
	r.pool[addr] = c
	return c, nil
}

func (r *OwnerRouter) remember(key, addr string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.owners) >= maxOwners {
		r.owners = map[string]string{}
	}
	r.owners[key] = addr
	if len(r.pool) > maxPool {
		// Replicas come and go (new pod addresses): close the connections
		// no remembered owner uses.
		used := map[string]bool{}
		for _, a := range r.owners {
			used[a] = true
		}
		for a, c := range r.pool {
			if !used[a] {
				_ = c.Close()
				delete(r.pool, a)
			}
		}
	}
}

func (r *OwnerRouter) forget(key, addr string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.owners[key] == addr {
		delete(r.owners, key)
	}
}
