package grpcapi

import (
	"context"
	"log/slog"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
	"agentplane.dev/services/sandbox/internal/driver"
)

// ConnectMethod is exempt from the internal token: wrappers authenticate
// with their launch credential in Hello.
const ConnectMethod = "/agentplane.sandbox.v1.WrapperControlService/Connect"

// Wrapper serves WrapperControlService.
type Wrapper struct {
	sandboxv1.UnimplementedWrapperControlServiceServer
	Driver *driver.Driver
	Log    *slog.Logger // internal errors are logged here (toStatus)
}

// Connect authenticates the wrapper's Hello, then relays frames both ways
// until the stream or the wrapper's registration ends.
func (w *Wrapper) Connect(stream sandboxv1.WrapperControlService_ConnectServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	h := first.GetHello()
	if h == nil {
		return apierr.Error(codes.InvalidArgument, ReasonHelloRequired, "the first frame must be Hello")
	}
	if !validSandboxID(h.GetSandboxId()) {
		return stream.Send(driver.Shutdown(sandboxv1.ShutdownReason_SHUTDOWN_REASON_STALE_ALLOCATION, "unknown sandbox"))
	}
	res, err := w.Driver.Hello(stream.Context(), h)
	if err != nil {
		return toStatus(stream.Context(), w.Log, err)
	}
	if res.Shutdown != nil {
		return stream.Send(res.Shutdown)
	}
	c := res.Conn
	defer w.Driver.Disconnected(c)
	if err := stream.Send(res.Ack); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	recvErr := make(chan error, 1)
	go func() {
		for {
			f, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			w.Driver.Frame(c, f)
		}
	}()
	for {
		select {
		case m := <-c.Send:
			if err := stream.Send(m); err != nil {
				return err
			}
			if m.GetShutdown() != nil {
				return nil
			}
		case <-c.Closed:
			// Drain what was queued before the close (a final Shutdown).
			for {
				select {
				case m := <-c.Send:
					_ = stream.Send(m)
				default:
					return toStatus(ctx, w.Log, c.Err())
				}
			}
		case err := <-recvErr:
			_ = err
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
