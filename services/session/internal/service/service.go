// Package service runs the session service's use cases: it loads and
// changes sessions through the store, talks to the sandbox, credential and
// ingest services through small interfaces, and runs the background loops
// (backstops, retention, deletion reconciliation). It imports no gRPC.
package service

import (
	"agentplane.dev/pkg/egresspolicy"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// Config holds the service's timing; every number is configurable.
type Config struct {
	Backstops         session.Backstops
	Retention         time.Duration // idle sessions older than this are deleted
	SweepInterval     time.Duration // backstops and retention; ≤ 0 disables the loop
	ReconcileInterval time.Duration // deletion reconciler; ≤ 0 disables the loop
	DeletionBackoff   session.Backoff
	DeletionLeaseTTL  time.Duration
	WipeLocatorTTL    time.Duration         // ≤ 0: store.DefaultWipeLocatorTTL
	PeerTimeout       time.Duration         // bound on every peer call
	WatchBlock        time.Duration         // XREAD BLOCK per round of a watcher
	Owner             string                // this replica's name in leases
	EgressMaxRules    int                   // rules of one egress policy; ≤ 0: egresspolicy.DefaultMaxRules
	Suspend           session.SuspendPolicy // when idle runtimes are suspended (SuspendIdle)
	Prices            session.PriceTable    // prices usage by model; nil: no cost
	Now               func() time.Time
}

// Service is the session service.
type Service struct {
	store   *store.Store
	watch   *store.WatchConns
	sandbox Sandbox
	creds   Credentials // nil: skipped
	history History     // nil: skipped
	log     *slog.Logger
	cfg     Config

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	running map[string]bool // sessions with a drain goroutine
	again   map[string]bool // kicked again while draining
	traces  pendingTraces   // caller spans of queued messages (tracing.go)
	metrics *Metrics        // nil: none
	drained [drainStripes]atomic.Uint64
}

// Deps are the service's collaborators.
type Deps struct {
	Store       *store.Store
	Watchers    *store.WatchConns // connections for blocking stream reads
	Sandbox     Sandbox
	Credentials Credentials
	History     History
	Logger      *slog.Logger
	Metrics     *Metrics // optional (metrics.go)
}

// New builds the service; Start runs its loops and Close stops them.
func New(d Deps, cfg Config) *Service {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Service{
		store: d.Store, watch: d.Watchers, sandbox: d.Sandbox, creds: d.Credentials, history: d.History,
		log: d.Logger, cfg: cfg, ctx: ctx, cancel: cancel, metrics: d.Metrics,
		running: map[string]bool{}, again: map[string]bool{},
	}
	d.Store.ScheduleSuspends(cfg.Suspend.Due)
	if s.creds == nil {
		s.log.Info("credential service not configured: backing credentials are not stored or released (dev only)")
	}
	if s.history == nil {
		s.log.Info("ingest service not configured: runtime history is not deleted with sessions (dev only)")
	}
	return s
}

// Start runs the sweeper, the idle suspender and the deletion reconciler
// until Close.
func (s *Service) Start() {
	s.loop(s.cfg.SweepInterval, s.Sweep)
	s.loop(s.cfg.SweepInterval, s.SuspendIdle)
	s.loop(s.cfg.ReconcileInterval, s.ReconcileDue)
}

// Close stops the loops and waits for every background goroutine.
func (s *Service) Close() {
	s.cancel()
	s.wg.Wait()
}

func (s *Service) loop(every time.Duration, fn func(context.Context)) {
	if every <= 0 {
		return
	}
	s.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
				fn(s.ctx)
			}
		}
	})
}

func (s *Service) now() time.Time { return s.cfg.Now() }

func (s *Service) peerCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, s.cfg.PeerTimeout)
}

// update changes a session (and its schedules) atomically.
func (s *Service) update(ctx context.Context, id string, load store.Load, fn func(*session.Aggregate) error) (*session.Aggregate, error) {
	var before, after states
	a, err := s.store.Update(ctx, id, load, func(a *session.Aggregate) error {
		before = statesOf(a)
		if err := fn(a); err != nil {
			return err
		}
		after = statesOf(a)
		return nil
	})
	if err == nil {
		s.metrics.committed(before, after)
	}
	return a, err
}

// CreateInput is a validated CreateSession request.
type CreateInput struct {
	ID, UserID, OrgID  string
	RepoURL, Directory string
	Class              session.CredentialClass
	Secret             string
	SandboxID          string
	Labels             map[string]string
	Agent              session.Agent
	RepoRef            string
	RepoDepth          uint32
	GitToken           string // optional; write-only
	GitUsername        string
	GitPushPrefix      string // "": gitrepo.DefaultPushBranchPrefix
	Egress             egresspolicy.Policy
	SuspendAfter       time.Duration // zero: the profile's default
}

func newID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "ses-" + hex.EncodeToString(b[:])
}

// Create stores a session after handing its secret to the credential
// service. Repeating the same request with the same id returns the session.
func (s *Service) Create(ctx context.Context, in CreateInput) (*session.Session, error) {
	if in.ID == "" {
		in.ID = newID()
	}
	if in.SandboxID == "" {
		in.SandboxID = session.SandboxFor(in.OrgID, in.UserID)
	}
	digest := session.Digest(in.Secret)
	gitDigest := ""
	if in.GitToken != "" {
		gitDigest = session.Digest(in.GitToken)
	}
	asked := &session.Session{RepoURL: in.RepoURL, PushPrefix: in.GitPushPrefix}
	same := func(old *session.Session) error {
		if old.UserID != in.UserID || old.OrgID != in.OrgID || old.Directory != in.Directory ||
			old.RepoURL != in.RepoURL || old.CredentialClass != in.Class || old.SandboxID != in.SandboxID ||
			old.SecretDigest != digest || !sameAgent(old.Agent, in.Agent) ||
			old.RepoRef != in.RepoRef || old.RepoDepth != in.RepoDepth || old.GitSecretDigest != gitDigest ||
			old.SuspendAfter != in.SuspendAfter || old.PushBranchPrefix() != asked.PushBranchPrefix() {
			return session.ErrSessionConflict
		}
		return nil
	}
	if err := session.Invalid(session.CheckEgress("egress", in.Egress, s.cfg.EgressMaxRules)); err != nil {
		return nil, err
	}
	if old, err := s.store.Get(ctx, in.ID); err == nil {
		if err := same(old); err != nil {
			return nil, err
		}
		return old, nil
	}
	if err := s.claimSandbox(ctx, in.SandboxID, session.Tenant{Org: in.OrgID, User: in.UserID}); err != nil {
		return nil, err
	}
	if err := s.checkWorktree(ctx, &in); err != nil {
		return nil, err
	}
	ref, gitRef, err := s.putCredentials(ctx, in)
	if err != nil {
		return nil, err
	}
	now := s.now()
	sess := &session.Session{
		ID: in.ID, UserID: in.UserID, OrgID: in.OrgID, RepoURL: in.RepoURL, Directory: in.Directory,
		CredentialClass: in.Class, CredentialRef: ref, SecretDigest: digest, SandboxID: in.SandboxID,
		State: session.StateActive, Labels: in.Labels, Agent: in.Agent,
		RepoRef: in.RepoRef, RepoDepth: in.RepoDepth, GitCredentialRef: gitRef, GitSecretDigest: gitDigest,
		PushPrefix: in.GitPushPrefix,
		Egress:     in.Egress, EgressVersion: 1, SuspendAfter: in.SuspendAfter,
		Route:      session.RouteView{State: session.RouteUnknown, SandboxID: in.SandboxID, UpdateTime: now},
		CreateTime: now, UpdateTime: now,
	}
	stored, created, err := s.store.Create(ctx, sess, same)
	if err == nil && created {
		s.metrics.created()
	}
	return stored, err
}

// checkWorktree asks the sandbox service about the session's agent and
// directory before anything is stored: an unknown or uninstalled agent
// profile is refused (the sandbox service owns the profiles; in.Agent
// becomes the resolved one), and so is a session whose repository or
// agent differs from what the directory is bound to, now rather than at
// its first message.
func (s *Service) checkWorktree(ctx context.Context, in *CreateInput) error {
	if in.Agent.Profile != "" || in.Agent.Model != "" {
		pctx, cancel := s.peerCtx(ctx)
		resolved, err := s.sandbox.CheckAgent(pctx, in.Agent)
		cancel()
		if err != nil {
			return err
		}
		in.Agent = resolved
	}
	pctx, cancel := s.peerCtx(ctx)
	defer cancel()
	return s.sandbox.CheckWorktree(pctx, &session.Session{SandboxID: in.SandboxID, Directory: in.Directory, RepoURL: in.RepoURL, Agent: in.Agent})
}

// putCredentials hands the session's secret, and for a session with a
// repository its git credential, to the credential service; it returns
// their references (none without a credential service). The git
// credential is stored even without a token: the repository is then
// cloned anonymously through the git route, which admits only it.
func (s *Service) putCredentials(ctx context.Context, in CreateInput) (ref, gitRef string, err error) {
	if s.creds == nil {
		return "", "", nil
	}
	pctx, cancel := s.peerCtx(ctx)
	ref, err = s.creds.Put(pctx, in.ID, in.Class, in.Secret)
	cancel()
	if err != nil {
		return "", "", fmt.Errorf("%w: credential: %w", session.ErrPeerUnavailable, err)
	}
	if in.RepoURL == "" {
		return ref, "", nil
	}
	pctx, cancel = s.peerCtx(ctx)
	gitRef, err = s.creds.PutGit(pctx, in.ID, in.RepoURL, in.GitUsername, in.GitPushPrefix, in.GitToken)
	cancel()
	if err != nil {
		return "", "", fmt.Errorf("%w: credential: %w", session.ErrPeerUnavailable, err)
	}
	return ref, gitRef, nil
}

// claimSandbox binds the session's sandbox to its tenant, or refuses a
// sandbox of another tenant, before anything of the session is stored
// (DESIGN.md 3.3 "Tenancy").
func (s *Service) claimSandbox(ctx context.Context, sandboxID string, t session.Tenant) error {
	if session.OthersDefaultSandbox(sandboxID, t) {
		return session.ErrSandboxTenantMismatch
	}
	pctx, cancel := s.peerCtx(ctx)
	defer cancel()
	return s.sandbox.ClaimSandbox(pctx, sandboxID, t)
}

// sameAgent compares the agent of a stored session with a repeated
// request's (which names it as asked, before resolution).
func sameAgent(stored, asked session.Agent) bool {
	return (asked.Profile == "" || asked.Profile == stored.Profile) && (asked.Model == "" || asked.Model == stored.Model) &&
		slices.Equal(stored.RejectToolKinds, asked.RejectToolKinds)
}

// Get returns a session (including one being deleted).
func (s *Service) Get(ctx context.Context, id string) (*session.Session, error) {
	return s.store.Get(ctx, id)
}

// List pages sessions of an org (and user), newest first.
func (s *Service) List(ctx context.Context, org, user, cursor string, size int) ([]*session.Session, string, error) {
	if cursor != "" && !store.ValidPageCursor(cursor) {
		return nil, "", session.ErrInvalidPageToken
	}
	return s.store.ListSessions(ctx, org, user, cursor, size)
}

// Send queues a message (idempotent on its id) and kicks delivery.
func (s *Service) Send(ctx context.Context, id, msgID, content string) (*session.Message, error) {
	var msg *session.Message
	var created bool
	gen := s.drainGen(id)
	a, err := s.update(ctx, id, store.Load{MessageID: msgID}, func(a *session.Aggregate) error {
		if a.Intent != nil {
			return session.ErrSessionNotFound
		}
		var err error
		msg, created, err = a.Send(msgID, content, s.now())
		return err
	})
	if err != nil {
		return nil, err
	}
	if !created {
		// A retry: the first attempt may have stored the message and failed
		// after (its write not confirmed on a replica), before it kicked a
		// drain; left alone the message would wait for the redrive sweep.
		m, err := s.store.GetMessage(ctx, id, msgID)
		if err == nil && m.State == session.MessageQueued {
			s.kick(id)
		}
		return m, err
	}
	s.traces.remember(ctx, id)
	s.kickFrom(id, a, gen)
	return msg, nil
}

// GetMessage returns a message with its content.
func (s *Service) GetMessage(ctx context.Context, id, msgID string) (*session.Message, error) {
	if _, err := s.liveOrDeleting(ctx, id); err != nil {
		return nil, err
	}
	return s.store.GetMessage(ctx, id, msgID)
}

// ListMessages pages messages in queue order.
func (s *Service) ListMessages(ctx context.Context, id string, afterSeq uint64, size int) ([]*session.Message, bool, error) {
	if _, err := s.liveOrDeleting(ctx, id); err != nil {
		return nil, false, err
	}
	return s.store.ListMessages(ctx, id, afterSeq, size)
}

func (s *Service) liveOrDeleting(ctx context.Context, id string) (*session.Session, error) {
	return s.store.Get(ctx, id)
}

// Cancel cancels a queued or accepted message; accepted work also gets a
// best-effort abort.
func (s *Service) Cancel(ctx context.Context, id, msgID string) (*session.Message, error) {
	var msg *session.Message
	var abort bool
	a, err := s.update(ctx, id, store.Load{MessageID: msgID}, func(a *session.Aggregate) error {
		if a.Intent != nil {
			return session.ErrSessionNotFound
		}
		msg, abort = a.Cancel(s.now())
		if msg == nil {
			return session.ErrMessageNotFound
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if abort {
		s.abort(ctx, &a.Session, msgID)
	}
	return s.store.GetMessage(ctx, id, msgID)
}

// Stop cancels queued and accepted work and sends a best-effort abort.
func (s *Service) Stop(ctx context.Context, id string) (*session.Session, error) {
	var abort bool
	a, err := s.update(ctx, id, store.Load{}, func(a *session.Aggregate) error {
		if a.Intent != nil {
			return session.ErrSessionNotFound
		}
		abort = a.Stop(s.now())
		return nil
	})
	if err != nil {
		return nil, err
	}
	if abort {
		s.abort(ctx, &a.Session, "")
	}
	return &a.Session, nil
}

func (s *Service) abort(ctx context.Context, sess *session.Session, msgID string) {
	pctx, cancel := s.peerCtx(context.WithoutCancel(ctx))
	defer cancel()
	if err := s.sandbox.Abort(pctx, sess, msgID); err != nil {
		s.log.WarnContext(ctx, "best-effort abort failed", "session_id", sess.ID, "error", err)
	}
}

// ErrNotFound reports whether err means the session is gone.
func ErrNotFound(err error) bool { return errors.Is(err, session.ErrSessionNotFound) }
