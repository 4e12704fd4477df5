// Package control is the wrapper's control stream to the sandbox service's
// WrapperControlService: it dials the control addresses in turn, says
// Hello, keeps the stream alive with heartbeats, sends the wrapper's frames
// from an outbox kept across reconnects, hands every service frame but
// Shutdown to the wrapper, and reconnects with backoff until told to shut
// down or the reconnect window passes without the control plane.
package control

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"

	"agentplane.dev/pkg/apierr"
	sandboxv1 "agentplane.dev/pkg/gen/agentplane/sandbox/v1"
)

// Wrapper is what the stream needs of the wrapper.
type Wrapper interface {
	// Hello is the Hello for a new stream (with the routes it serves).
	Hello() *sandboxv1.Hello
	// Heartbeat is the heartbeat to send now.
	Heartbeat() *sandboxv1.Heartbeat
	// Handle applies one service frame other than Shutdown; it must not
	// block the stream for long.
	Handle(*sandboxv1.ConnectResponse)
}

// Config of a stream.
type Config struct {
	// Addrs are the addresses to try, in turn (asked before each attempt:
	// a control directory gains sockets).
	Addrs           func() []string
	Heartbeat       time.Duration // until HelloAck says otherwise
	ReconnectWindow time.Duration // until HelloAck says otherwise
	Logger          *slog.Logger
}

// End says why Run returned.
type End int

const (
	// Shutdown: the service told the wrapper to stop (or ctx ended).
	Shutdown End = iota
	// Unreachable: the reconnect window passed without the control plane.
	Unreachable
)

// keptOutcomes is how many sent turn outcomes a wrapper sends again on each
// new stream. A Send that returned nil only queued the frame, and a replica
// forwards outcomes to the session service from memory: when it dies, what
// it had not forwarded is lost, and the turn's messages would wait for the
// session's no_outcome backstop. The session service settles a turn once
// (by turn id), so an outcome that arrives twice changes nothing.
const keptOutcomes = 16

// maxOutbox bounds the frames waiting for a stream.
const maxOutbox = 10000

// Stream is the wrapper's control stream.
type Stream struct {
	cfg Config
	w   Wrapper
	log *slog.Logger
	// ownerAddr is the owner a non-owner replica named at the last Hello;
	// the next attempt dials it (once) instead of the next control address.
	ownerAddr string

	mu     sync.Mutex
	outbox []*sandboxv1.ConnectRequest // frames waiting for a stream
	sent   []*sandboxv1.ConnectRequest // the last keptOutcomes outcome frames sent; see replaySent
	wake   chan struct{}
	// dropped counts the frames Emit dropped past maxOutbox.
	dropped atomic.Uint64
}

// Dropped is how many frames were dropped because the outbox was full.
func (s *Stream) Dropped() uint64 { return s.dropped.Load() }

// droppable: progress and runtime events are a stream the service can
// miss; the other frames are what it acts on.
func droppable(f *sandboxv1.ConnectRequest) bool {
	return f.GetProgress() != nil || f.GetRuntimeEvents() != nil
}

// New is a stream for w; Run connects it.
func New(cfg Config, w Wrapper) *Stream {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = 5 * time.Second
	}
	if cfg.ReconnectWindow <= 0 {
		cfg.ReconnectWindow = 90 * time.Second
	}
	return &Stream{cfg: cfg, w: w, log: cfg.Logger, wake: make(chan struct{}, 1)}
}

// Emit queues a frame for the service (kept across reconnects). Past
// maxOutbox queued, a progress or events frame is dropped; any other frame
// (a turn outcome, a route state, a worktree result) takes the place of the
// oldest progress or events frame queued, so an outcome is not what is
// lost (its loss would surface only through the session's 125-minute
// backstop). Every drop is counted (Dropped) and logged, once per 1,000.
func (s *Stream) Emit(f *sandboxv1.ConnectRequest) {
	s.mu.Lock()
	lost := (*sandboxv1.ConnectRequest)(nil)
	if len(s.outbox) >= maxOutbox {
		lost = f
		if !droppable(f) {
			if i := slices.IndexFunc(s.outbox, droppable); i >= 0 {
				lost = s.outbox[i]
				s.outbox = slices.Delete(s.outbox, i, i+1)
			}
		}
	}
	if lost != f {
		s.outbox = append(s.outbox, f)
	}
	s.mu.Unlock()
	if lost != nil {
		if n := s.dropped.Add(1); n%1000 == 1 {
			s.log.Warn("control frames dropped: the outbox is full", "frame", fmt.Sprintf("%T", lost.GetFrame()),
				"dropped", n, "outbox", maxOutbox)
		}
	}
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Run connects, serves a stream until it breaks, and reconnects with
// backoff until shutdown or the reconnect window passes.
func (s *Stream) Run(ctx context.Context) End {
	disconnectedSince := time.Now()
	backoff := 100 * time.Millisecond
	for attempt := 0; ; attempt++ {
		addrs := s.cfg.Addrs()
		addr := addrs[attempt%len(addrs)]
		if s.ownerAddr != "" {
			addr, s.ownerAddr = s.ownerAddr, ""
		}
		connected, shutdown := s.serve(ctx, addr)
		if shutdown {
			return Shutdown
		}
		if connected {
			disconnectedSince = time.Now()
			backoff = 100 * time.Millisecond
		}
		if time.Since(disconnectedSince) > s.cfg.ReconnectWindow {
			s.log.Warn("control plane unreachable past the reconnect window; stopping runtime", "window", s.cfg.ReconnectWindow.String())
			return Unreachable
		}
		select {
		case <-ctx.Done():
			return Shutdown
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 5*time.Second, s.cfg.ReconnectWindow/4+time.Millisecond)
	}
}

// serve runs one control stream. connected reports whether a HelloAck came;
// shutdown whether the service told the wrapper to stop.
func (s *Stream) serve(ctx context.Context, addr string) (connected, shutdown bool) {
	// Keepalive pings notice a control plane that stopped answering (a
	// paused or partitioned replica) even though TCP stays open.
	ka := max(2*s.cfg.Heartbeat, 2*time.Second)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: ka, Timeout: ka, PermitWithoutStream: true}))
	if err != nil {
		return false, false
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := sandboxv1.NewWrapperControlServiceClient(conn).Connect(ctx)
	if err != nil {
		return false, false
	}
	if err := stream.Send(&sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Hello{Hello: s.w.Hello()}}); err != nil {
		return false, false
	}
	first, err := stream.Recv()
	if err != nil {
		// Reached a replica that does not own the sandbox (through a
		// balancer): it names the owner, try there next.
		if apierr.Reason(err) == "SANDBOX_OWNED_ELSEWHERE" {
			s.ownerAddr = apierr.Info(err).GetMetadata()[apierr.MetaOwnerAddr]
		}
		return false, false
	}
	if sd := first.GetShutdown(); sd != nil {
		s.log.Info("shutdown at hello", "reason", sd.GetReason().String(), "detail", sd.GetDetail())
		return false, true
	}
	ack := first.GetHelloAck()
	if ack == nil {
		return false, false
	}
	if d := ack.GetHeartbeatInterval().AsDuration(); d > 0 {
		s.cfg.Heartbeat = d
	}
	if d := ack.GetReconnectWindow().AsDuration(); d > 0 {
		s.cfg.ReconnectWindow = d
	}
	s.log.Info("connected", "addr", addr, "contract", ack.GetContract().String())
	s.replaySent()

	sendErr := make(chan error, 1)
	go func() { sendErr <- s.sendLoop(ctx, stream) }()
	for {
		msg, err := stream.Recv()
		if err != nil {
			cancel()
			<-sendErr //nolint:errcheck // the stream is over; the send loop's error adds nothing
			return true, false
		}
		if sd := msg.GetShutdown(); sd != nil {
			s.log.Info("shutdown", "reason", sd.GetReason().String())
			cancel()
			<-sendErr //nolint:errcheck // the stream is over; the send loop's error adds nothing
			return true, true
		}
		s.w.Handle(msg)
	}
}

// sendLoop sends heartbeats and queued frames; a frame whose send fails goes
// back to the head of the outbox for the next stream.
func (s *Stream) sendLoop(ctx context.Context, stream sandboxv1.WrapperControlService_ConnectClient) error {
	tick := time.NewTicker(s.cfg.Heartbeat)
	defer tick.Stop()
	for {
		for {
			s.mu.Lock()
			if len(s.outbox) == 0 {
				s.mu.Unlock()
				break
			}
			f := s.outbox[0]
			s.outbox = s.outbox[1:]
			s.mu.Unlock()
			if err := stream.Send(f); err != nil {
				s.mu.Lock()
				s.outbox = append([]*sandboxv1.ConnectRequest{f}, s.outbox...)
				s.mu.Unlock()
				return err
			}
			if f.GetOutcome() != nil {
				s.keepSent(f)
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.wake:
		case <-tick.C:
			hb := &sandboxv1.ConnectRequest{Frame: &sandboxv1.ConnectRequest_Heartbeat{Heartbeat: s.w.Heartbeat()}}
			if err := stream.Send(hb); err != nil {
				return err
			}
		}
	}
}

// keepSent remembers a sent outcome frame (once: a replayed frame is the
// same pointer), keeping the last keptOutcomes.
func (s *Stream) keepSent(f *sandboxv1.ConnectRequest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if slices.Contains(s.sent, f) {
		return
	}
	s.sent = append(s.sent, f)
	if len(s.sent) > keptOutcomes {
		s.sent = slices.Clone(s.sent[len(s.sent)-keptOutcomes:])
	}
}

// replaySent puts the kept outcomes, in the order they were sent, ahead of
// the outbox for the stream that just connected. Its Hello already
// restored the routes they belong to. A replay the last stream broke off
// is still in the outbox and is not queued twice.
func (s *Stream) replaySent() {
	s.mu.Lock()
	defer s.mu.Unlock()
	var again []*sandboxv1.ConnectRequest
	for _, f := range s.sent {
		if !slices.Contains(s.outbox, f) {
			again = append(again, f)
		}
	}
	s.outbox = append(again, s.outbox...)
}
