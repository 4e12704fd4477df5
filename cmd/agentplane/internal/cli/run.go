package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"agentplane.dev/client"
	"agentplane.dev/pkg/config"
	"agentplane.dev/pkg/egresspolicy"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"google.golang.org/protobuf/types/known/durationpb"
)

// sessionOptions are the flags that describe a new session.
type sessionOptions struct {
	dir, repo, agent, user, org, sandbox, id, egress string
	gitTokenFile, gitUser, gitPushPrefix             string
	suspendAfter                                     time.Duration
}

func (e *env) sessionFlags(fs *flag.FlagSet, withID bool) *sessionOptions {
	o := &sessionOptions{}
	wd, _ := os.Getwd()
	user := e.env("AGENTPLANE_USER", e.env("USER", "dev"))
	fs.StringVar(&o.dir, "dir", wd, "worktree directory of the session")
	fs.StringVar(&o.repo, "repo", "", "repository URL of the worktree (worktree.repo_url)")
	fs.StringVar(&o.agent, "agent", "", "agent profile to run (scripted, opencode, kilo, ...; default: the server's)")
	fs.StringVar(&o.user, "user", user, "owning user id (env AGENTPLANE_USER, else $USER)")
	fs.StringVar(&o.org, "org", e.env("AGENTPLANE_ORG", "dev"), "owning organization id (env AGENTPLANE_ORG)")
	fs.StringVar(&o.sandbox, "sandbox", "", "sandbox to run in (default: one per org and user)")
	fs.StringVar(&o.egress, "egress", "", "egress allowlist of the session: host patterns with optional ports and private address ranges, comma separated (registry.npmjs.org,*.pypi.org:443,example.com:80|8080,10.0.0.0/8); default: deny (besides the deployment's default)")
	fs.StringVar(&o.gitTokenFile, "git-token-file", "", "file holding the token for --repo's HTTPS git access (env AGENTPLANE_GIT_TOKEN holds the token itself); it goes to the credential service, never into the sandbox")
	fs.DurationVar(&o.suspendAfter, "suspend-after", 0, "suspend the session's agent after this long without a turn (1s to 720h; default: the server's for the agent profile)")
	fs.StringVar(&o.gitUser, "git-username", "", "user name sent with the git token (default: x-access-token)")
	fs.StringVar(&o.gitPushPrefix, "git-push-prefix", "", "branch prefix the session's pushes are confined to, ending in / (default: agent/); the default branch stays unpushable unless it is under the prefix")
	if withID {
		fs.StringVar(&o.id, "id", "", "session id to use (default: a new one); repeating a create with it is idempotent")
	}
	return o
}

// PlaceholderCredential is the backing credential of new sessions when
// neither AGENTPLANE_CREDENTIAL nor agentplane dev gives one: the scripted
// runtime and dev's fake model are content with it.
const PlaceholderCredential = "sk-agentplane-dev-placeholder"

// request builds the CreateSession request. The backing credential comes
// from AGENTPLANE_CREDENTIAL (never a flag: argv is visible to every user of
// the machine), else from the state file of the agentplane dev at --addr
// (its --provider-key-file), else a placeholder.
func (o *sessionOptions) request(e *env) (*sessionv1.CreateSessionRequest, error) {
	dir, err := filepath.Abs(o.dir)
	if err != nil {
		return nil, fmt.Errorf("--dir: %w", err)
	}
	secret := PlaceholderCredential
	if v, ok := e.lookup("AGENTPLANE_CREDENTIAL"); ok && v != "" {
		secret = v
	} else if st, ok := readDevState(e.addr); ok && st.Credential != "" {
		secret = st.Credential // agentplane dev's --provider-key-file
	}
	class := sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC
	if v, _ := e.lookup("AGENTPLANE_CREDENTIAL_CLASS"); v == "delegated" {
		class = sessionv1.CredentialClass_CREDENTIAL_CLASS_DELEGATED
	} else if v != "" && v != "static" {
		return nil, fmt.Errorf("AGENTPLANE_CREDENTIAL_CLASS %q: want static or delegated", v)
	}
	req := &sessionv1.CreateSessionRequest{
		SessionId: o.id, UserId: o.user, OrgId: o.org, SandboxId: o.sandbox,
		Worktree:   &sessionv1.Worktree{Directory: filepath.Clean(dir), RepoUrl: o.repo},
		Credential: &sessionv1.CredentialInput{Class: class, Secret: secret},
	}
	if o.agent != "" {
		req.Agent = &sessionv1.Agent{Profile: o.agent}
	}
	if o.egress != "" {
		if req.Egress, err = egressPolicy(o.egress); err != nil {
			return nil, fmt.Errorf("--egress: %w", err)
		}
	}
	if o.suspendAfter != 0 {
		req.SuspendAfter = durationpb.New(o.suspendAfter) // the server checks the range
	}
	if o.repo == "" {
		// A token in the environment is for the sessions that name a
		// repository; a flag without one is a mistake.
		for _, f := range []struct{ name, value string }{{"--git-token-file", o.gitTokenFile}, {"--git-username", o.gitUser}, {"--git-push-prefix", o.gitPushPrefix}} {
			if f.value != "" {
				return nil, fmt.Errorf("%s needs --repo (the repository it is for)", f.name)
			}
		}
		return req, nil
	}
	tok, err := o.gitToken(e)
	if err != nil {
		return nil, err
	}
	if tok != "" {
		req.GitCredential = &sessionv1.GitCredentialInput{Token: tok, Username: o.gitUser, PushBranchPrefix: o.gitPushPrefix}
	}
	return req, nil
}

// gitToken is the git token from --git-token-file, else AGENTPLANE_GIT_TOKEN
// (never a flag's value: argv is visible to every user of the machine).
func (o *sessionOptions) gitToken(e *env) (string, error) {
	if o.gitTokenFile != "" {
		tok, err := config.ReadSecretFile(o.gitTokenFile)
		if err != nil {
			return "", fmt.Errorf("--git-token-file: %w", err)
		}
		return tok, nil
	}
	if e.env("AGENTPLANE_GIT_TOKEN", "") == "" {
		// Both travel in the git credential, which a token makes.
		if o.gitUser != "" {
			return "", errors.New("--git-username needs a token (--git-token-file or AGENTPLANE_GIT_TOKEN)")
		}
		if o.gitPushPrefix != "" {
			return "", errors.New("--git-push-prefix needs a token (--git-token-file or AGENTPLANE_GIT_TOKEN)")
		}
	}
	return e.env("AGENTPLANE_GIT_TOKEN", ""), nil
}

// egressPolicy parses an allowlist ("" is the empty policy).
func egressPolicy(list string) (*sessionv1.EgressPolicy, error) {
	out := &sessionv1.EgressPolicy{}
	if list == "" {
		return out, nil
	}
	p, err := egresspolicy.ParseList(list, egresspolicy.MaxRulesCeiling)
	if err != nil {
		return nil, err
	}
	out.PrivateNetworks = p.PrivateNetworks
	for _, r := range p.Allow {
		out.Allow = append(out.Allow, &sessionv1.EgressRule{Host: r.Host, Ports: r.Ports})
	}
	return out, nil
}

// run is `agentplane run`: create a session, send the prompt, follow the
// turn to its outcome. Ctrl-C stops the session (cancelling the message) and
// exits 130 once the message is cancelled; a second Ctrl-C exits at once.
func (e *env) run(args []string) int {
	fs := e.flags(`[flags] "prompt"`)
	so := e.sessionFlags(fs, false)
	timeout := fs.Duration("timeout", 0, "give up following the turn after this long (0: no limit)")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	req, err := so.request(e)
	if err != nil {
		return e.fail(err)
	}
	c, err := e.dial()
	if err != nil {
		return e.fail(err)
	}
	defer c.Close()

	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if *timeout > 0 {
		var cancelT context.CancelFunc
		ctx, cancelT = context.WithTimeout(ctx, *timeout)
		defer cancelT()
	}
	it := &interrupt{cancel: cancel, stop: func(id string) { e.stopAfterInterrupt(c, id) }}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		for {
			select {
			case <-sigs:
				it.signal(e)
			case <-ctx.Done():
				return
			}
		}
	}()

	// By the clock as well as by ctx: a call can fail DeadlineExceeded (gRPC
	// reads the deadline) before ctx's own timer has fired on a loaded machine.
	timedOut := func(before string) bool {
		if *timeout > 0 && (errors.Is(ctx.Err(), context.DeadlineExceeded) || !time.Now().Before(start.Add(*timeout))) {
			fmt.Fprintf(e.stderr, "%s: --timeout %s passed before %s\n", e.name, *timeout, before)
			return true
		}
		return false
	}
	cctx, cancelC := context.WithTimeout(ctx, callTimeout)
	sess, err := c.CreateSession(cctx, req)
	cancelC()
	if err != nil {
		if it.happened() {
			return exitInterrupted
		}
		if timedOut("the session was created") {
			return exitFailed
		}
		return e.fail(err)
	}
	sid := sess.GetSessionId()
	sctx, cancelS := context.WithTimeout(ctx, callTimeout)
	msg, err := c.SendMessage(sctx, &sessionv1.SendMessageRequest{SessionId: sid, MessageId: client.NewMessageID(), Content: pos[0]})
	cancelS()
	if err != nil {
		if it.happened() {
			e.stopAfterInterrupt(c, sid) // the message may have been stored
			return exitInterrupted
		}
		if timedOut("the message was sent to session " + sid) {
			return exitFailed
		}
		return e.fail(err)
	}
	it.watching(sid)

	r := newRenderer(e.output, e.stdout, start)
	r.Header(sess)
	result := sessionv1.MessageState_MESSAGE_STATE_UNSPECIFIED
	for ev, err := range c.Watch(ctx, sid, "") {
		if err != nil {
			r.Close()
			switch {
			case it.happened():
				return exitInterrupted
			case errors.Is(err, context.DeadlineExceeded) || errors.Is(ctx.Err(), context.DeadlineExceeded):
				fmt.Fprintf(e.stderr, "%s: no outcome within --timeout %s; the turn goes on in session %s\n", e.name, *timeout, sid)
				return exitFailed
			}
			return e.fail(err)
		}
		r.Event(ev)
		if st, done := settled(ev, msg.GetMessageId()); done {
			result = st
			if ev.GetMessage().GetFailureReason() == "route_failed" {
				e.showRouteFailure(c, sid, r)
			}
			break
		}
	}
	r.Close()
	switch {
	case result == sessionv1.MessageState_MESSAGE_STATE_COMPLETED:
		return exitOK
	case result == sessionv1.MessageState_MESSAGE_STATE_CANCELLED && it.happened():
		return exitInterrupted
	default:
		return exitFailed
	}
}

// settled reports whether ev ends the message's turn, and how.
func settled(ev *sessionv1.SessionEvent, messageID string) (sessionv1.MessageState, bool) {
	if o := ev.GetOutcome(); o != nil && o.GetLastMessageId() == messageID {
		switch o.GetResult() {
		case runtimev1.TurnResult_TURN_RESULT_SUCCEEDED:
			return sessionv1.MessageState_MESSAGE_STATE_COMPLETED, true
		case runtimev1.TurnResult_TURN_RESULT_CANCELLED:
			return sessionv1.MessageState_MESSAGE_STATE_CANCELLED, true
		default:
			return sessionv1.MessageState_MESSAGE_STATE_FAILED, true
		}
	}
	if m := ev.GetMessage(); m != nil && m.GetMessageId() == messageID {
		switch st := m.GetState(); st {
		case sessionv1.MessageState_MESSAGE_STATE_COMPLETED, sessionv1.MessageState_MESSAGE_STATE_FAILED, sessionv1.MessageState_MESSAGE_STATE_CANCELLED:
			return st, true
		}
	}
	return 0, false
}

// interrupt is what Ctrl-C does to a run: before the message is sent it
// ends the run; while following the turn the first one stops the session
// (its message ends cancelled and the run exits 130), a second one ends
// the run at once.
type interrupt struct {
	mu        sync.Mutex
	n         int
	sessionID string // set once the message is sent
	cancel    context.CancelFunc
	stop      func(sessionID string)
}

func (i *interrupt) signal(e *env) {
	i.mu.Lock()
	i.n++
	n, id := i.n, i.sessionID
	i.mu.Unlock()
	if n > 1 || id == "" {
		i.cancel()
		return
	}
	fmt.Fprintln(e.stderr, "\ninterrupted: stopping the session (Ctrl-C again to quit at once)")
	go func() {
		i.stop(id)
		// The cancelled message ends the run; if its event never comes, this does.
		time.AfterFunc(30*time.Second, i.cancel)
	}()
}

func (i *interrupt) watching(sessionID string) {
	i.mu.Lock()
	i.sessionID = sessionID
	n := i.n
	i.mu.Unlock()
	if n > 0 { // interrupted while the message was being sent
		go i.stop(sessionID)
	}
}

func (i *interrupt) happened() bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.n > 0
}

// stopAfterInterrupt stops the session's work (its own deadline: the run's
// context may be the one being cancelled).
func (e *env) stopAfterInterrupt(c *client.Client, sessionID string) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if _, err := c.StopSession(ctx, &sessionv1.StopSessionRequest{SessionId: sessionID}); err != nil {
		fmt.Fprintf(e.stderr, "%s: stopping session %s: %s\n", e.name, sessionID, e.describe(err))
	}
}

// showRouteFailure shows people why the route failed: the message that
// failed route_failed ends the run before the route's own event comes.
func (e *env) showRouteFailure(c *client.Client, sessionID string, r renderer) {
	h, ok := r.(*human)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	s, err := c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: sessionID})
	if err != nil {
		return // the failed message has been shown; its route's reason is a detail
	}
	h.RouteFailure(s.GetRoute())
}
