package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"iter"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"agentplane.dev/client"
	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// session runs `agentplane session <verb>`.
func (e *env) session(verb string, args []string) int {
	switch verb {
	case "create":
		return e.sessionCreate(args)
	case "get":
		return e.unaryOnID(args, "ID", func(ctx context.Context, c *client.Client, id string) (any, error) {
			return c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: id})
		})
	case "stop":
		return e.unaryOnID(args, "ID", func(ctx context.Context, c *client.Client, id string) (any, error) {
			return c.StopSession(ctx, &sessionv1.StopSessionRequest{SessionId: id})
		})
	case "suspend":
		return e.sessionSuspend(args)
	case "resume":
		return e.sessionResume(args)
	case "list":
		return e.sessionList(args)
	case "send":
		return e.sessionSend(args)
	case "watch":
		return e.sessionWatch(args)
	case "delete":
		return e.sessionDelete(args)
	case "changes":
		return e.sessionChanges(args)
	case "push":
		return e.sessionPush(args)
	case "files":
		return e.sessionFiles(args)
	case "cat":
		return e.sessionCat(args)
	case "put":
		return e.sessionPut(args)
	case "egress":
		return e.sessionEgress(args)
	case "export":
		return e.sessionExport(args)
	case "usage":
		return e.sessionUsage(args)
	case "audit":
		return e.sessionAudit(args)
	}
	return e.fail(fmt.Errorf("unknown verb %q", verb))
}

func (e *env) sessionCreate(args []string) int {
	fs := e.flags("[flags]")
	so := e.sessionFlags(fs, true)
	if _, code, ok := e.parse(fs, args, 0); !ok {
		return code
	}
	req, err := so.request(e)
	if err != nil {
		return e.fail(err)
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		s, err := c.CreateSession(ctx, req)
		if err == nil {
			e.showSession(s)
		}
		return err
	})
}

// unaryOnID runs a call on one session id and shows its result.
func (e *env) unaryOnID(args []string, what string, call func(context.Context, *client.Client, string) (any, error)) int {
	fs := e.flags("[flags] " + what)
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		v, err := call(ctx, c, pos[0])
		if s, ok := v.(*sessionv1.Session); ok && err == nil {
			e.showSession(s)
		}
		return err
	})
}

// sessionSuspend suspends a session's runtime (SuspendSession), waiting
// until its processes are verified gone.
func (e *env) sessionSuspend(args []string) int {
	fs := e.flags("[flags] ID")
	force := fs.Bool("force", false, "cancel queued and running work first instead of failing with TURN_RUNNING")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		s, err := c.SuspendSession(ctx, &sessionv1.SuspendSessionRequest{SessionId: pos[0], Force: *force})
		if err == nil {
			e.showSession(s)
		}
		return err
	})
}

func (e *env) sessionResume(args []string) int {
	fs := e.flags("[flags] ID")
	restart := fs.Bool("restart", false, "when the route failed resume_state_lost, continue with a new conversation")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		s, err := c.ResumeSession(ctx, &sessionv1.ResumeSessionRequest{SessionId: pos[0], Restart: *restart})
		if err == nil {
			e.showSession(s)
		}
		return err
	})
}

func (e *env) sessionList(args []string) int {
	fs := e.flags("[flags]")
	org := fs.String("org", e.env("AGENTPLANE_ORG", "dev"), "organization whose sessions to list (env AGENTPLANE_ORG)")
	user := fs.String("user", "", "only this user's sessions")
	if _, code, ok := e.parse(fs, args, 0); !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		if e.output == "human" {
			fmt.Fprintln(tw, "SESSION\tSTATE\tROUTE\tUSER\tDIRECTORY\tCREATED")
		}
		for s, err := range c.ListSessions(ctx, &sessionv1.ListSessionsRequest{OrgId: *org, UserId: *user}) {
			if err != nil {
				return err
			}
			if e.output == "json" {
				writeJSON(e.stdout, s)
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", s.GetSessionId(), enumName(s.GetState().String(), "SESSION_STATE_"),
				routeText(s.GetRoute()), s.GetUserId(), s.GetWorktree().GetDirectory(), when(s.GetCreateTime()))
		}
		return tw.Flush()
	})
}

// sessionExport prints a session's whole history (every runtime session of
// it, in order): one item per line, or one HistoryItem per line as JSON.
func (e *env) sessionExport(args []string) int {
	fs := e.flags("[flags] ID")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		return printRows(e, "RUNTIME SESSION\tITEM\tTYPE\tVERSION\tPAYLOAD",
			c.ExportHistory(ctx, &sessionv1.ExportHistoryRequest{SessionId: pos[0]}),
			func(it *sessionv1.HistoryItem) string {
				item := it.GetItem()
				payload := string(item.GetPayload())
				if len(payload) > 120 {
					payload = payload[:120] + "…"
				}
				return fmt.Sprintf("%s\t%s\t%s\t%d\t%s", it.GetRuntimeSessionId(), item.GetItemId(),
					enumName(item.GetType().String(), "ITEM_TYPE_"), item.GetVersion(), payload)
			})
	})
}

// sessionAudit lists a session's audit records, oldest first: one line
// each (time, turn, then the request or the egress decision).
func (e *env) sessionAudit(args []string) int {
	fs := e.flags("[flags] ID")
	turn := fs.String("turn", "", "only this turn's records (a message id)")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		return printRows(e, "TIME\tTURN\tKIND\tWHAT\tRESULT",
			c.ListAuditRecords(ctx, &sessionv1.ListAuditRecordsRequest{SessionId: pos[0], TurnId: *turn}), auditRow)
	})
}

// auditRow is one audit record as a line: time, turn, then the request or
// the egress decision.
func auditRow(r *sessionv1.AuditRecord) string {
	t := r.GetTurnId()
	if t == "" {
		t = "-"
	}
	when := r.GetTime().AsTime().UTC().Format("15:04:05.000")
	if p := r.GetProxyRequest(); p != nil {
		return fmt.Sprintf("%s\t%s\t%s\t%s %s\t%d (%d B in, %d B out, %s)", when, t, p.GetRoute(), p.GetMethod(), p.GetPathTemplate(),
			p.GetStatus(), p.GetBytesIn(), p.GetBytesOut(), p.GetDuration().AsDuration().Round(time.Millisecond))
	}
	g := r.GetEgress()
	result := g.GetDecision()
	if g.GetReason() != "" {
		result += " (" + g.GetReason() + ")"
	}
	if g.GetExpected() {
		result += fmt.Sprintf(", expected ×%d", g.GetCount())
	}
	return fmt.Sprintf("%s\t%s\tegress\t%s:%d\t%s", when, t, g.GetHost(), g.GetPort(), result)
}

// printRows prints every item of a paged listing: a table under header, or
// one JSON object per line with --output json.
func printRows[T proto.Message](e *env, header string, items iter.Seq2[T, error], row func(T) string) error {
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	if e.output == "human" {
		fmt.Fprintln(tw, header)
	}
	for it, err := range items {
		if err != nil {
			return err
		}
		if e.output == "json" {
			writeJSON(e.stdout, it)
			continue
		}
		fmt.Fprintln(tw, row(it))
	}
	return tw.Flush()
}

func (e *env) sessionSend(args []string) int {
	fs := e.flags(`[flags] ID "text"`)
	id := fs.String("message-id", "", "message id (default: a new one); sending again with it delivers the message once")
	pos, code, ok := e.parse(fs, args, 2)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		m, err := c.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: pos[0], MessageId: *id, Content: pos[1]})
		if err != nil {
			return err
		}
		if e.output == "json" {
			writeJSON(e.stdout, m)
			return nil
		}
		fmt.Fprintf(e.stdout, "message %s %s (#%d); follow it with: agentplane session watch %s\n",
			m.GetMessageId(), enumName(m.GetState().String(), "MESSAGE_STATE_"), m.GetSequence(), m.GetSessionId())
		return nil
	})
}

// sessionWatch follows a session's events until Ctrl-C (exit 130).
func (e *env) sessionWatch(args []string) int {
	fs := e.flags("[flags] ID")
	from := fs.String("from", "", `resume after this event cursor ("": the oldest retained event, "$": new events only)`)
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	c, err := e.dial()
	if err != nil {
		return e.fail(err)
	}
	defer c.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	r := newRenderer(e.output, e.stdout, time.Now())
	defer r.Close()
	for ev, err := range c.Watch(ctx, pos[0], *from) {
		if err != nil {
			if ctx.Err() != nil {
				return exitInterrupted
			}
			r.Close()
			return e.fail(err)
		}
		r.Event(ev)
	}
	return exitOK
}

// sessionDelete deletes a session, waiting through a pending cleanup.
func (e *env) sessionDelete(args []string) int {
	fs := e.flags("[flags] ID")
	timeout := fs.Duration("timeout", 5*time.Minute, "how long to wait for the cleanup to be verified")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	c, err := e.dial(client.WithRetryHook(func(r client.Retry) {
		if client.Reason(r.Err) == client.ReasonDeletionPendingCleanup && e.output == "human" {
			fmt.Fprintf(e.stderr, "cleanup pending (%s); checking again in %s\n", pendingStep(r.Err), r.Delay.Round(time.Millisecond))
		}
	}))
	if err != nil {
		return e.fail(err)
	}
	defer c.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if err := c.DeleteSession(ctx, &sessionv1.DeleteSessionRequest{SessionId: pos[0]}); err != nil {
		if ctx.Err() == context.Canceled {
			return exitInterrupted
		}
		return e.fail(err)
	}
	if e.output == "human" {
		fmt.Fprintf(e.stdout, "deleted %s\n", pos[0])
	} else {
		fmt.Fprintf(e.stdout, "{\"deleted\":%q}\n", pos[0])
	}
	return exitOK
}

func pendingStep(err error) string {
	if info := apierr.Info(err); info != nil && info.GetMetadata()["pending_step"] != "" {
		return info.GetMetadata()["pending_step"]
	}
	return "in progress"
}

// withClient dials, runs fn under the call timeout and maps its error.
func (e *env) withClient(fn func(context.Context, *client.Client) error) int {
	c, err := e.dial()
	if err != nil {
		return e.fail(err)
	}
	defer c.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	if err := fn(ctx, c); err != nil {
		if ctx.Err() == context.Canceled {
			return exitInterrupted
		}
		return e.fail(err)
	}
	return exitOK
}

func (e *env) showSession(s *sessionv1.Session) {
	if e.output == "json" {
		writeJSON(e.stdout, s)
		return
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	where := s.GetWorktree().GetDirectory()
	if u := s.GetWorktree().GetRepoUrl(); u != "" {
		where += " (" + u + ")"
	}
	fmt.Fprintf(tw, "session\t%s\n", s.GetSessionId())
	fmt.Fprintf(tw, "state\t%s\n", enumName(s.GetState().String(), "SESSION_STATE_"))
	fmt.Fprintf(tw, "route\t%s\n", routeText(s.GetRoute()))
	fmt.Fprintf(tw, "owner\t%s / %s\n", s.GetUserId(), s.GetOrgId())
	fmt.Fprintf(tw, "worktree\t%s\n", where)
	if p := s.GetPushBranchPrefix(); p != "" {
		fmt.Fprintf(tw, "pushes\t%s*\n", p)
	}
	if u := s.GetUsage(); u.GetRequests() > 0 {
		fmt.Fprintf(tw, "usage\t%s\n", usageText(u))
	}
	fmt.Fprintf(tw, "sandbox\t%s\n", s.GetSandboxId())
	fmt.Fprintf(tw, "created\t%s\n", when(s.GetCreateTime()))
	_ = tw.Flush()
}

func routeText(r *sessionv1.RouteView) string {
	s := enumName(r.GetState().String(), "ROUTE_STATE_")
	switch {
	case r.GetStep() != "":
		s += " (" + r.GetStep() + ")"
	case r.GetFailureReason() != "":
		s += " (" + r.GetFailureReason() + ")"
	}
	return s
}

func when(t *timestamppb.Timestamp) string {
	if t == nil {
		return "-"
	}
	return t.AsTime().Local().Format(time.DateTime)
}

// sessionChanges shows the worktree's change set: one line per file, then
// the diff.
func (e *env) sessionChanges(args []string) int {
	fs := e.flags("[flags] ID")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		resp, err := c.Raw().GetWorktreeChanges(ctx, &sessionv1.GetWorktreeChangesRequest{SessionId: pos[0]})
		if err != nil {
			return err
		}
		if e.output == "json" {
			writeJSON(e.stdout, resp)
			return nil
		}
		ch := resp.GetChanges()
		if len(ch.GetFiles()) == 0 {
			fmt.Fprintf(e.stdout, "no changes (HEAD %s)\n", short(ch.GetHeadCommit()))
			return nil
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		for _, f := range ch.GetFiles() {
			fmt.Fprintf(tw, "%s\t%s\n", enumName(f.GetKind().String(), "FILE_CHANGE_KIND_"), f.GetPath())
		}
		_ = tw.Flush()
		if d := ch.GetDiff(); d != "" {
			fmt.Fprintf(e.stdout, "\n%s", d)
			if !strings.HasSuffix(d, "\n") {
				fmt.Fprintln(e.stdout)
			}
		}
		if ch.GetDiffTruncated() {
			fmt.Fprintln(e.stdout, "(diff cut at the server's bound)")
		}
		return nil
	})
}

// sessionPush commits the worktree's changes and pushes them to a branch.
func (e *env) sessionPush(args []string) int {
	fs := e.flags("[flags] ID")
	branch := fs.String("branch", "", "branch to push to, without refs/heads/ (required)")
	message := fs.String("message", "changes from an agentplane session", "commit message of the changes")
	authorName := fs.String("author-name", "", "the commit's author name (empty: agentplane; the committer stays agentplane)")
	authorEmail := fs.String("author-email", "", "the commit's author email (empty: agentplane@localhost)")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	if *branch == "" {
		return e.fail(errors.New("--branch is required (agentplane session push -h)"))
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		resp, err := c.Raw().PushWorktree(ctx, &sessionv1.PushWorktreeRequest{SessionId: pos[0], Branch: *branch, CommitMessage: *message,
			AuthorName: *authorName, AuthorEmail: *authorEmail})
		if err != nil {
			return err
		}
		if e.output == "json" {
			writeJSON(e.stdout, resp)
			return nil
		}
		what := "pushed HEAD (no changes to commit)"
		if resp.GetCommitted() {
			what = "committed and pushed"
		}
		fmt.Fprintf(e.stdout, "%s %s to %s\n", what, short(resp.GetCommitId()), resp.GetRef())
		return nil
	})
}

// sessionFiles lists a directory of the worktree: type, mode, size, name.
func (e *env) sessionFiles(args []string) int {
	fs := e.flags("[flags] ID [DIR]")
	pos, code, ok := e.parse(fs, args, -1)
	if !ok {
		return code
	}
	if len(pos) < 1 || len(pos) > 2 {
		return e.fail(fmt.Errorf("want 1 or 2 argument(s), got %d (%s -h)", len(pos), e.name))
	}
	dir := ""
	if len(pos) == 2 {
		dir = pos[1]
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		var files []*runtimev1.WorktreeFile
		for f, err := range c.ListWorktreeFiles(ctx, &sessionv1.ListWorktreeFilesRequest{SessionId: pos[0], Path: dir}) {
			if err != nil {
				return err
			}
			files = append(files, f)
		}
		if e.output == "json" {
			writeJSON(e.stdout, &sessionv1.ListWorktreeFilesResponse{Files: files})
			return nil
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		for _, f := range files {
			name := f.GetName()
			if f.GetType() == runtimev1.WorktreeFileType_WORKTREE_FILE_TYPE_DIRECTORY {
				name += "/"
			}
			fmt.Fprintf(tw, "%s\t%04o\t%d\t%s\n", enumName(f.GetType().String(), "WORKTREE_FILE_TYPE_"), f.GetMode(), f.GetSize(), name)
		}
		return tw.Flush()
	})
}

// sessionCat writes a file of the worktree to stdout, as it is (no
// rendering, also with --output json).
func (e *env) sessionCat(args []string) int {
	fs := e.flags("[flags] ID PATH")
	pos, code, ok := e.parse(fs, args, 2)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		_, err := c.CopyWorktreeFile(ctx, pos[0], pos[1], e.stdout)
		return err
	})
}

// sessionPut writes one file of the worktree from a local file or stdin.
func (e *env) sessionPut(args []string) int {
	fs := e.flags("[flags] ID PATH [FILE]")
	mode := fs.String("mode", "", "permission bits in octal, e.g. 0755 (default: keep an existing file's, 0644 for a new one)")
	force := fs.Bool("force", false, "write even while a turn is running or queued")
	pos, code, ok := e.parse(fs, args, -1)
	if !ok {
		return code
	}
	if len(pos) < 2 || len(pos) > 3 {
		return e.fail(fmt.Errorf("want 2 or 3 argument(s), got %d (%s -h)", len(pos), e.name))
	}
	var bits uint64
	if *mode != "" {
		var err error
		if bits, err = strconv.ParseUint(*mode, 8, 32); err != nil || bits > 0o777 {
			return e.fail(fmt.Errorf("--mode %q: want octal permission bits, at most 0777", *mode))
		}
	}
	var data []byte
	var err error
	if len(pos) == 3 && pos[2] != "-" {
		data, err = os.ReadFile(pos[2])
	} else {
		data, err = io.ReadAll(io.LimitReader(os.Stdin, 3<<20+1))
	}
	if err != nil {
		return e.fail(err)
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		resp, err := c.WriteWorktreeFiles(ctx, &sessionv1.WriteWorktreeFilesRequest{SessionId: pos[0], Force: *force,
			Files: []*runtimev1.WorktreeFileWrite{{Path: pos[1], Data: data, Mode: uint32(bits)}}})
		if err != nil {
			return err
		}
		if e.output == "json" {
			writeJSON(e.stdout, resp)
			return nil
		}
		fmt.Fprintf(e.stdout, "wrote %d bytes to %s\n", resp.GetBytesWritten(), pos[1])
		return nil
	})
}

// sessionEgress replaces the session's egress allowlist with --allow's, or
// without --allow shows the policy in force (and changes nothing).
func (e *env) sessionEgress(args []string) int {
	fs := e.flags("[flags] ID")
	allow := fs.String("allow", "", "the new allowlist: host patterns with optional ports and private address ranges, comma separated (as create's --egress); \"\": only the deployment's default; not given: show the policy in force")
	version := fs.Uint64("expected-version", 0, "replace only if this is the policy's current version (0: whatever is current)")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	replace := false
	fs.Visit(func(f *flag.Flag) { replace = replace || f.Name == "allow" })
	if !replace {
		if *version != 0 {
			return e.fail(errors.New("--expected-version needs --allow (without it egress shows the policy)"))
		}
		return e.withClient(func(ctx context.Context, c *client.Client) error {
			s, err := c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: pos[0]})
			if err == nil {
				e.showEgress(&sessionv1.UpdateEgressPolicyResponse{Egress: s.GetEgress(), Version: s.GetEgressVersion()})
			}
			return err
		})
	}
	policy, err := egressPolicy(*allow)
	if err != nil {
		return e.fail(fmt.Errorf("--allow: %w", err))
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		resp, err := c.Raw().UpdateEgressPolicy(ctx, &sessionv1.UpdateEgressPolicyRequest{SessionId: pos[0], Egress: policy, ExpectedVersion: *version})
		if err == nil {
			e.showEgress(resp)
		}
		return err
	})
}

// showEgress prints a policy and its version, the rules as --allow takes
// them.
func (e *env) showEgress(p *sessionv1.UpdateEgressPolicyResponse) {
	if e.output == "json" {
		writeJSON(e.stdout, p)
		return
	}
	var rules []string
	for _, r := range p.GetEgress().GetAllow() {
		rules = append(rules, ruleText(r))
	}
	rules = append(rules, p.GetEgress().GetPrivateNetworks()...)
	if len(rules) == 0 {
		rules = []string{"(only the deployment's default)"}
	}
	fmt.Fprintf(e.stdout, "egress policy version %d: %s\n", p.GetVersion(), strings.Join(rules, ","))
}

// ruleText writes a rule as --allow takes it (host, or host:port|port).
func ruleText(r *sessionv1.EgressRule) string {
	if len(r.GetPorts()) == 0 {
		return r.GetHost()
	}
	ports := make([]string, len(r.GetPorts()))
	for i, p := range r.GetPorts() {
		ports[i] = strconv.FormatUint(uint64(p), 10)
	}
	return r.GetHost() + ":" + strings.Join(ports, "|")
}

// short is a commit id's first 12 characters.
func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// sessionUsage shows the session's provider usage so far (GetSession's
// usage: every provider response the credential proxy read usage from).
func (e *env) sessionUsage(args []string) int {
	fs := e.flags("[flags] ID")
	pos, code, ok := e.parse(fs, args, 1)
	if !ok {
		return code
	}
	return e.withClient(func(ctx context.Context, c *client.Client) error {
		s, err := c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: pos[0]})
		if err != nil {
			return err
		}
		u := s.GetUsage()
		if u == nil {
			u = &runtimev1.TokenUsage{}
		}
		if e.output == "json" {
			writeJSON(e.stdout, u)
			return nil
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "input tokens\t%d\n", u.GetInputTokens())
		fmt.Fprintf(tw, "cached tokens\t%d\n", u.GetCachedTokens())
		fmt.Fprintf(tw, "output tokens\t%d\n", u.GetOutputTokens())
		fmt.Fprintf(tw, "requests\t%d\n", u.GetRequests())
		model := u.GetModel()
		if model == "" {
			model = "-"
		}
		fmt.Fprintf(tw, "model\t%s\n", model)
		fmt.Fprintf(tw, "cost\t%s\n", costText(u))
		return tw.Flush()
	})
}

// usageText is a TokenUsage on one line: "120 in / 45 out tokens (20
// cached), 2 requests, $0.000305".
func usageText(u *runtimev1.TokenUsage) string {
	s := fmt.Sprintf("%d in / %d out tokens", u.GetInputTokens(), u.GetOutputTokens())
	if u.GetCachedTokens() > 0 {
		s += fmt.Sprintf(" (%d cached)", u.GetCachedTokens())
	}
	s += fmt.Sprintf(", %d request", u.GetRequests())
	if u.GetRequests() != 1 {
		s += "s"
	}
	if u.GetCostUsd() > 0 {
		s += ", " + costText(u)
	}
	return s
}

// costText is the usage's cost in US dollars, or why there is none.
func costText(u *runtimev1.TokenUsage) string {
	switch {
	case u.GetCostUsd() > 0:
	case u.GetRequests() == 0:
		return "-"
	default:
		return "- (the session service's price table, AGENTPLANE_SESSION_PRICE_TABLE, prices none of these tokens)"
	}
	return "$" + strconv.FormatFloat(u.GetCostUsd(), 'f', 6, 64)
}
