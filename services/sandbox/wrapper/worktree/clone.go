package worktree

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Marker is written into .git once a clone is complete; a workspace with a
// .git but without it is a half clone and is never reused as warm.
const Marker = "agentplane-clone-complete"

// Spec is one route's worktree preparation.
type Spec struct {
	Dir      string // the workspace (physical path)
	RepoURL  string // empty: no clone
	Ref      string // branch, tag or commit; empty: the default branch
	Depth    int    // 0: full history
	ProxyURL string // the sandbox's proxy base
	Handle   func() string
	MaxBytes int64 // REPO_TOO_LARGE above this many bytes on disk; 0: no bound
}

// Progress receives clone steps (lower snake step, human detail).
type Progress func(step, detail string)

// locks serializes preparation per workspace within the wrapper: the
// sessions of one directory share one wrapper (worktree contract), so the
// second waits for the first's clone and finds it warm.
var locks sync.Map // dir → *sync.Mutex

func lockDir(dir string) func() {
	m, _ := locks.LoadOrStore(dir, &sync.Mutex{})
	mu := m.(*sync.Mutex)
	mu.Lock()
	return mu.Unlock
}

// Prepare makes the workspace ready: an existing workspace is reused as it
// is (warm); a missing or empty one is cloned from RepoURL when set; a half
// clone (a .git without Marker) is wiped and cloned again. It reports
// whether the workspace was warm.
func Prepare(ctx context.Context, s Spec, progress Progress) (warm bool, err error) {
	defer lockDir(s.Dir)()
	if s.RepoURL == "" {
		st, err := os.Stat(s.Dir)
		if err == nil && st.IsDir() {
			return true, nil
		}
		return false, os.MkdirAll(s.Dir, 0o755)
	}
	repo, err := ParseRepoURL(s.RepoURL)
	if err != nil {
		return false, &Failure{Reason: ReasonBadRepoURL, Detail: err.Error()}
	}
	switch state, err := inspect(s.Dir); {
	case err != nil:
		return false, err
	case state == stateCloned || state == stateForeign:
		return true, nil
	case state == stateHalf:
		progress("prepare_worktree", "removing an incomplete clone")
		if err := emptyDir(s.Dir); err != nil {
			return false, err
		}
	}
	if err := os.MkdirAll(s.Dir, 0o755); err != nil {
		return false, err
	}
	if err := clone(ctx, s, repo, progress); err != nil {
		_ = emptyDir(s.Dir) // nothing half-cloned stays behind
		return false, err
	}
	return false, nil
}

type dirState int

const (
	stateMissing dirState = iota // missing or empty: clone
	stateHalf                    // .git without the marker: wipe, clone
	stateCloned                  // a complete clone: warm
	stateForeign                 // files that are not a clone of ours: warm, as they are
)

func inspect(dir string) (dirState, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return stateMissing, nil
	}
	if err != nil {
		return 0, err
	}
	if len(entries) == 0 {
		return stateMissing, nil
	}
	if _, err := os.Stat(filepath.Join(dir, ".git", Marker)); err == nil {
		return stateCloned, nil
	}
	if _, err := os.Stat(filepath.Join(dir, ".git")); err == nil {
		return stateHalf, nil
	}
	return stateForeign, nil
}

// emptyDir removes what is inside dir, not dir itself (it may be a mount point
// or a process's working directory).
func emptyDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

var commitish = regexp.MustCompile(`^[0-9a-fA-F]{7,40}$`)

func clone(ctx context.Context, s Spec, repo Repo, progress Progress) error {
	rl, err := startRelay(s.ProxyURL, repo, s.Handle)
	if err != nil {
		return &Failure{Reason: ReasonRepoUnreachable, Detail: "the credential proxy is not configured", Retryable: true}
	}
	defer rl.close()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if s.MaxBytes > 0 {
		go watchSize(ctx, s.Dir, s.MaxBytes, cancel)
	}
	isCommit := s.Ref != "" && commitish.MatchString(s.Ref)
	args := []string{"clone", "--progress", "--no-tags"}
	if s.Depth > 0 && !isCommit {
		args = append(args, "--depth", fmt.Sprint(s.Depth))
	}
	switch {
	case isCommit:
		args = append(args, "--no-checkout")
	case s.Ref != "":
		args = append(args, "--branch", s.Ref)
	}
	args = append(args, "--", rl.url(repo), ".")
	progress("prepare_worktree", "cloning "+repo.Host+repo.Path)
	stderr, err := runProgress(ctx, s.Dir, progress, args...)
	if err := tooLarge(ctx); err != nil {
		return err
	}
	if err == nil && s.MaxBytes > 0 && du(s.Dir) > s.MaxBytes {
		return &Failure{Reason: ReasonRepoTooLarge, Detail: "the clone passed the workspace's repository size bound"}
	}
	if err != nil {
		f := classifyFetch(stderr)
		if f.Reason == ReasonCloneFail && diskFull(s.Dir) {
			// git says "unable to write file" for a full disk at checkout;
			// the errno of a probe write is the evidence.
			f = &Failure{Reason: ReasonNoSpace, Detail: "no space left on device", Retryable: true}
		}
		return f
	}
	if isCommit {
		progress("prepare_worktree", "checking out "+s.Ref)
		if _, e, err := git(ctx, s.Dir, nil, "checkout", "--detach", "--quiet", s.Ref); err != nil {
			if f := classifyFetch(e); f.Reason == ReasonNoSpace {
				return f
			}
			return &Failure{Reason: ReasonRefNotFound, Detail: "no commit " + s.Ref + " in the repository"}
		}
	}
	// origin names the proxy, never the relay (gone after this command) and
	// never a credential.
	if _, e, err := git(ctx, s.Dir, nil, "remote", "set-url", "origin", repo.ProxyRemote(s.ProxyURL)); err != nil {
		return classifyFetch(e)
	}
	if err := os.WriteFile(filepath.Join(s.Dir, ".git", Marker), []byte(repo.Host+repo.Path+"\n"), 0o644); err != nil {
		if errors.Is(err, syscall.ENOSPC) {
			return &Failure{Reason: ReasonNoSpace, Detail: "no space left on device", Retryable: true}
		}
		return err
	}
	progress("prepare_worktree", "checked out")
	return nil
}

// diskFull reports whether a probe write into dir fails with ENOSPC.
func diskFull(dir string) bool {
	f, err := os.CreateTemp(dir, ".agentplane-space-probe-")
	if err != nil {
		return errors.Is(err, syscall.ENOSPC)
	}
	defer func() { _ = os.Remove(f.Name()) }()
	defer f.Close()
	chunk := make([]byte, 64<<10)
	for range 16 {
		if _, err := f.Write(chunk); err != nil {
			return errors.Is(err, syscall.ENOSPC)
		}
	}
	return errors.Is(f.Sync(), syscall.ENOSPC)
}

var errTooLarge = errors.New("repository larger than the bound")

func tooLarge(ctx context.Context) error {
	if errors.Is(context.Cause(ctx), errTooLarge) {
		return &Failure{Reason: ReasonRepoTooLarge, Detail: "the clone passed the workspace's repository size bound"}
	}
	return nil
}

// watchSize stops the clone once the workspace holds more than max bytes.
func watchSize(ctx context.Context, dir string, max int64, stop context.CancelCauseFunc) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if du(dir) > max {
			stop(errTooLarge)
			return
		}
	}
}

func du(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}

// runProgress runs git, turning its progress lines ("Receiving objects:
// 45% (450/1000)") into progress reports at most every 10 points of a
// phase, and returns its stderr (bounded).
func runProgress(ctx context.Context, dir string, progress Progress, args ...string) (string, error) {
	cmd := gitCmd(ctx, dir, gitEnv(), args...)
	cmd.Stderr = nil // read through the pipe instead of kept as a tail
	pipe, err := cmd.StderrPipe()
	if err != nil {
		return "", err
	}
	if err := cmd.Start(); err != nil {
		return "", err
	}
	tail := readProgress(pipe, progress)
	return tail, cmd.Wait()
}

var progressLine = regexp.MustCompile(`^(?:remote: )?([A-Za-z ]+):\s+(\d+)%`)

func readProgress(r io.Reader, progress Progress) string {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), 64<<10)
	sc.Split(splitCR)
	var tail []string
	enospc := "" // kept whatever follows it: it decides the sandbox's recovery
	lastPhase, lastPct := "", -1
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		if m := progressLine.FindStringSubmatch(line); m != nil {
			phase := strings.ToLower(m[1])
			var pct int
			_, _ = fmt.Sscan(m[2], &pct)
			if phase != lastPhase || pct/10 > lastPct/10 {
				step := "clone"
				if phase == "updating files" {
					step = "checkout"
				}
				progress(step, fmt.Sprintf("%s %d%%", phase, pct))
				lastPhase, lastPct = phase, pct
			}
			continue
		}
		if enospc == "" && strings.Contains(strings.ToLower(line), "no space left on device") {
			enospc = line
		}
		if len(line) > 512 {
			line = line[:512] + "…"
		}
		tail = append(tail, line)
		if len(tail) > 20 {
			tail = tail[1:]
		}
	}
	if enospc != "" {
		tail = append(tail, enospc)
	}
	// Whatever ended the scan, git's stderr is read to its end: a pipe
	// left full would block git until the clone's timeout.
	_, _ = io.Copy(io.Discard, r)
	return strings.Join(tail, "\n")
}

// maxLine bounds one line of git's stderr: a longer one comes in pieces
// (a remote's message or a hook's output has no bound), so the scanner
// never stops at a line over its buffer.
const maxLine = 4 << 10

// splitCR splits on \n and on the \r git uses to redraw a progress line,
// and cuts a line at maxLine.
func splitCR(data []byte, atEOF bool) (int, []byte, error) {
	for i, b := range data {
		if b == '\n' || b == '\r' {
			return i + 1, data[:i], nil
		}
		if i+1 == maxLine {
			return maxLine, data[:maxLine], nil
		}
	}
	if atEOF && len(data) > 0 {
		return len(data), data, nil
	}
	return 0, nil, nil
}
