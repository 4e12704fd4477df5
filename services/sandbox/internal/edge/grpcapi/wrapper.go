package grpcapi

import (
	"context"
	"log/slog"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/control/driver"
	"agentplane.dev/services/sandbox/internal/edge/wrapperconn"
)

// ConnectMethod is exempt from the internal token: wrappers authenticate
// with their launch credential in Hello.
const ConnectMethod = "/agentplane.sandbox.v1.WrapperControlService/Connect"

// ControlSocketServes is what the control socket, handed into every
// sandbox, serves: the wrapper's stream and health. Everything else
// (SandboxService, reflection) stays on the service's own port.
func ControlSocketServes(fullMethod string) bool {
	return fullMethod == ConnectMethod || fullMethod == "/grpc.health.v1.Health/Check" || fullMethod == "/grpc.health.v1.Health/Watch"
}

// Wrapper serves WrapperControlService.
type Wrapper struct {
	sandboxv1.UnimplementedWrapperControlServiceServer
	Driver *driver.Driver
	Log    *slog.Logger // internal errors are logged here (toStatus)
}

// Connect authenticates the wrapper's Hello, then relays frames both ways
// until the stream or the wrapper's registration ends. Frames cross in the
// driver's terms: wrapperconn converts them.
func (w *Wrapper) Connect(stream sandboxv1.WrapperControlService_ConnectServer) error {
	s := wrapperconn.Stream{S: stream}
	first, err := s.Recv()
	if err != nil {
		return err
	}
	h, ok := first.(driver.Hello)
	if !ok {
		return apierr.Error(codes.InvalidArgument, ReasonHelloRequired, "the first frame must be Hello")
	}
	if !validSandboxID(h.SandboxID) {
		return s.Send(driver.Shutdown{Reason: driver.StaleAllocation, Detail: "unknown sandbox"})
	}
	res, err := w.Driver.Hello(stream.Context(), h)
	if err != nil {
		return toStatus(stream.Context(), w.Log, err)
	}
	if res.Shutdown != nil {
		return s.Send(*res.Shutdown)
	}
	c := res.Conn
	defer w.Driver.Disconnected(c)
	if err := s.Send(res.Ack); err != nil {
		return err
	}
	return w.relay(stream.Context(), s, c)
}

// relay passes the wrapper's frames to the driver and the driver's to the
// wrapper until either side ends the stream.
func (w *Wrapper) relay(ctx context.Context, s wrapperconn.Stream, c *driver.Conn) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	recvErr := make(chan error, 1)
	go func() {
		for {
			f, err := s.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			if f != nil {
				w.Driver.Frame(c, f)
			}
		}
	}()
	for {
		select {
		case m := <-c.Send:
			if err := s.Send(m); err != nil {
				return err
			}
			if _, ok := m.(driver.Shutdown); ok {
				return nil
			}
		case <-c.Closed:
			// Drain what was queued before the close (a final Shutdown).
			for {
				select {
				case m := <-c.Send:
					_ = s.Send(m)
				default:
					return toStatus(ctx, w.Log, c.Err())
				}
			}
		case err := <-recvErr:
			_ = err // the wrapper ended its side (EOF, reset): nothing to answer
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
