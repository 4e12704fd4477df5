package grpcserver

import (
	"context"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"

	"agentplane.dev/pkg/apierr"
)

// ReasonMethodNotServed: a restricted listener does not serve the method.
const ReasonMethodNotServed = "METHOD_NOT_SERVED"

// ServeRestricted serves the server's services on ln too, but a call that
// arrives on it is refused (PERMISSION_DENIED METHOD_NOT_SERVED) unless
// allow admits its full method name: for a socket handed to less trusted
// callers, e.g. the sandbox service's control socket, which every sandbox
// holds. The check runs right after panic recovery, before auth, so the
// internal token opens nothing more there. It returns when ln fails or the
// server stops; call it after every service is registered.
func (s *Server) ServeRestricted(ln net.Listener, allow func(fullMethod string) bool) error {
	return s.grpc.Serve(restrictedListener{Listener: ln, allow: allow})
}

// restrictedListener marks each connection it accepts: the mark is the
// connection's local address, which gRPC hands to every call on it as
// peer.LocalAddr.
type restrictedListener struct {
	net.Listener
	allow func(string) bool
}

func (l restrictedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return restrictedConn{Conn: c, local: restrictedAddr{Addr: c.LocalAddr(), allow: l.allow}}, nil
}

type restrictedConn struct {
	net.Conn
	local restrictedAddr
}

func (c restrictedConn) LocalAddr() net.Addr { return c.local }

type restrictedAddr struct {
	net.Addr
	allow func(string) bool
}

// notServed refuses a call that arrived on a restricted listener and whose
// method that listener does not allow.
func notServed(ctx context.Context, fullMethod string) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	if ra, ok := p.LocalAddr.(restrictedAddr); ok && !ra.allow(fullMethod) {
		return apierr.Error(codes.PermissionDenied, ReasonMethodNotServed, "this socket does not serve the method")
	}
	return nil
}

func restrictUnary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := notServed(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func restrictStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := notServed(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return h(srv, ss)
}
