package capacity

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/services/sandbox/internal/node/provider"
	"agentplane.dev/services/sandbox/internal/node/provider/process"
)

func TestMain(m *testing.M) {
	if os.Getenv("HELPER_MODE") == "sleep" {
		time.Sleep(time.Hour)
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

const mib = 1 << 20

// tmpfs mounts a real 64 MiB tmpfs for the test (CI runs as root).
func tmpfs(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", dir).CombinedOutput()
	require.NoError(t, err, "mount tmpfs: %s", out)
	t.Cleanup(func() {
		out, err := exec.Command("umount", dir).CombinedOutput()
		require.NoError(t, err, "umount: %s", out)
	})
	return dir
}

type fixture struct {
	p   *process.Provider
	sb  string
	now time.Time
}

func newFixture(t *testing.T, procRoot string) *fixture {
	p, err := process.New(process.Config{Root: tmpfs(t), ProcRoot: procRoot})
	require.NoError(t, err)
	f := &fixture{p: p, sb: "t" + strconv.FormatInt(time.Now().UnixNano(), 36), now: time.Now()}
	require.NoError(t, p.Create(context.Background(), f.sb))
	t.Cleanup(func() {
		if sd := p.DiscoverSandbox(context.Background(), f.sb); sd.Kind == provider.Present {
			for k := range sd.ByRuntimeKey {
				p.Stop(context.Background(), provider.StopTarget{SandboxID: f.sb, RuntimeKey: k})
			}
		}
		p.Wait()
	})
	return f
}

// workspace prepares a workspace holding size bytes and sets its age
// (negative: from the future, i.e. unknown).
func (f *fixture) workspace(t *testing.T, name string, size int, age time.Duration) string {
	t.Helper()
	_, err := f.p.PrepareWorkspace(context.Background(), f.sb, name, name)
	require.NoError(t, err)
	if size > 0 {
		require.NoError(t, os.WriteFile(filepath.Join(f.p.WorkspaceDir(f.sb, name), "blob"), bytes.Repeat([]byte{1}, size), 0o644))
	}
	f.age(t, name, age)
	return process.WorkspaceName(name)
}

func (f *fixture) age(t *testing.T, name string, age time.Duration) {
	for _, d := range []string{f.p.WorkspaceDir(f.sb, name), f.p.HomeDir(f.sb, name)} {
		require.NoError(t, os.Chtimes(d, f.now.Add(-age), f.now.Add(-age)))
	}
}

func (f *fixture) liveWrapper(t *testing.T, name string) {
	_, err := f.p.Launch(context.Background(), provider.LaunchSpec{
		Markers: provider.Markers{SandboxID: f.sb, RuntimeKey: name, InstanceID: "i", Generation: 1},
		Path:    os.Args[0], Env: []string{"HELPER_MODE=sleep"}, Workspace: name,
	})
	require.NoError(t, err)
}

func (f *fixture) admission() *Admission {
	return New(f.p, Config{ThresholdBytes: 32 * mib, Now: func() time.Time { return f.now }})
}

func TestAboveThresholdMeasuresOnceAndCleansNothing(t *testing.T) {
	f := newFixture(t, "")
	f.workspace(t, "/stale", mib, time.Hour)
	rep, err := f.admission().Admit(context.Background(), f.sb, process.WorkspaceName("/new"), false)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Measurements)
	require.Zero(t, rep.Cleaned)
	require.DirExists(t, f.p.WorkspaceDir(f.sb, "/stale"))

	rep, err = f.admission().Admit(context.Background(), f.sb, "x", true)
	require.NoError(t, err)
	require.Zero(t, rep.Measurements, "warm workspace: no check")
}

// setupLow fills the tmpfs below the 32 MiB threshold with two stale
// workspaces (12 MiB each) and four that must survive: the current
// route's, a young one, one of unknown age, one with a live wrapper.
func setupLow(t *testing.T, f *fixture, youngSize int) (current string) {
	current = f.workspace(t, "/current", 6*mib, time.Hour)
	f.workspace(t, "/young", youngSize, 5*time.Minute)
	f.workspace(t, "/unknown", 2*mib, -time.Hour)
	f.workspace(t, "/live", 2*mib, time.Hour)
	f.liveWrapper(t, "/live")
	f.age(t, "/live", time.Hour)
	f.workspace(t, "/stale1", 12*mib, 30*time.Minute)
	f.workspace(t, "/stale2", 12*mib, 2*time.Hour)
	return current
}

func TestBelowThresholdCleansOnlyStaleAndPassesOnRecheck(t *testing.T) {
	f := newFixture(t, "")
	current := setupLow(t, f, 6*mib)
	c := f.p.Capacity(context.Background(), f.sb)
	require.Less(t, c.AvailableBytes, uint64(32*mib), "fixture is below the threshold")

	rep, err := f.admission().Admit(context.Background(), f.sb, current, false)
	require.NoError(t, err)
	require.Equal(t, 2, rep.Measurements)
	require.Equal(t, 2, rep.Cleaned)
	require.Equal(t, 4, rep.Skipped)
	require.GreaterOrEqual(t, rep.AvailableBytes, uint64(32*mib))
	for _, gone := range []string{"/stale1", "/stale2"} {
		require.NoDirExists(t, f.p.WorkspaceDir(f.sb, gone))
		require.NoDirExists(t, f.p.HomeDir(f.sb, gone))
	}
	for _, kept := range []string{"/current", "/young", "/unknown", "/live"} {
		require.DirExists(t, f.p.WorkspaceDir(f.sb, kept))
	}
}

func TestStillLowIsRejectedAndSandboxKept(t *testing.T) {
	f := newFixture(t, "")
	current := setupLow(t, f, 24*mib)
	_, err := f.admission().Admit(context.Background(), f.sb, current, false)
	require.ErrorIs(t, err, provider.ErrCapacityRejected)
	var rej *provider.CapacityRejectedError
	require.ErrorAs(t, err, &rej)
	require.Equal(t, 2, rej.Cleaned)
	require.Equal(t, 4, rej.Skipped)
	require.False(t, provider.StartsRecovery(err))
	require.DirExists(t, f.p.WorkspaceDir(f.sb, "/current"))
}

func TestFailedProcessListingCleansNothing(t *testing.T) {
	f := newFixture(t, filepath.Join(t.TempDir(), "no-proc"))
	current := f.workspace(t, "/current", 6*mib, time.Hour)
	f.workspace(t, "/stale1", 20*mib, time.Hour)
	f.workspace(t, "/stale2", 20*mib, time.Hour)
	_, err := f.admission().Admit(context.Background(), f.sb, current, false)
	var rej *provider.CapacityRejectedError
	require.ErrorAs(t, err, &rej)
	require.Zero(t, rej.Cleaned)
	require.Equal(t, 3, rej.Skipped)
	require.DirExists(t, f.p.WorkspaceDir(f.sb, "/stale1"))
}

func TestUnmeasurableNeverDestroys(t *testing.T) {
	f := newFixture(t, "")
	_, err := f.admission().Admit(context.Background(), f.sb+"-missing", "x", false)
	require.ErrorIs(t, err, provider.ErrCapacityUnmeasurable)
	require.False(t, provider.StartsRecovery(err))
}

// A real ENOSPC during workspace setup is ENOSPC evidence. The recovery
// of the failed route's runtime key (issue 33) removes only what of that
// key is recreatable: the half-made home of the new key goes, a workspace
// with a file in it stays (reported kept), and another key's workspace and
// another sandbox are not touched.
func TestENOSPCDuringSetupRecoversOnlyTheFailedKey(t *testing.T) {
	f := newFixture(t, "")
	ctx := context.Background()
	other := f.sb + "-other"
	require.NoError(t, f.p.Create(ctx, other))
	_, err := f.p.PrepareWorkspace(ctx, other, "/keep", "/keep")
	require.NoError(t, err)
	// A user's uncommitted work in a workspace of this sandbox, and a
	// workspace of the key that fails with a file in it too.
	_, err = f.p.PrepareWorkspace(ctx, f.sb, "/work", "/work")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(f.p.WorkspaceDir(f.sb, "/work"), "notes.txt"), []byte("unpushed"), 0o644))
	_, err = f.p.PrepareWorkspace(ctx, f.sb, "/failing", "/failing")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(f.p.WorkspaceDir(f.sb, "/failing"), "draft.txt"), []byte("uncommitted"), 0o644))

	fill, err := os.Create(filepath.Join(f.p.SandboxDir(f.sb), "fill"))
	require.NoError(t, err)
	chunk := bytes.Repeat([]byte{1}, mib)
	for {
		if _, err = fill.Write(chunk); err != nil {
			break
		}
	}
	require.ErrorIs(t, err, syscall.ENOSPC)
	// Fill the last partial page too.
	for {
		if _, err = fill.Write([]byte{1}); err != nil {
			break
		}
	}
	require.NoError(t, fill.Close())

	_, err = f.p.PrepareWorkspace(ctx, f.sb, "/new", "/new")
	require.Error(t, err)
	require.ErrorIs(t, err, provider.ErrENOSPC)
	require.ErrorIs(t, err, syscall.ENOSPC, "the errno is kept")
	require.True(t, provider.StartsRecovery(err))

	rec, err := f.p.RecoverKey(ctx, f.sb, "/new", "/new", false)
	require.NoError(t, err)
	require.False(t, rec.KeptWorkspace)
	require.NoDirExists(t, f.p.WorkspaceDir(f.sb, "/new"), "the failed key's empty workspace is recreatable")
	require.NoDirExists(t, f.p.HomeDir(f.sb, "/new"))

	rec, err = f.p.RecoverKey(ctx, f.sb, "/failing", "/failing", false)
	require.NoError(t, err)
	require.True(t, rec.KeptWorkspace, "a workspace with a file in it is kept and reported")
	require.Equal(t, []string{"home"}, rec.Removed, "a home holding only its record is recreatable")
	require.FileExists(t, filepath.Join(f.p.WorkspaceDir(f.sb, "/failing"), "draft.txt"))

	require.DirExists(t, f.p.SandboxDir(f.sb), "recovery never deletes the sandbox")
	require.FileExists(t, filepath.Join(f.p.WorkspaceDir(f.sb, "/work"), "notes.txt"), "another key's workspace is not touched")
	require.DirExists(t, f.p.HomeDir(f.sb, "/work"))
	require.DirExists(t, f.p.WorkspaceDir(other, "/keep"), "other sandbox on the same filesystem survives")
}

func TestENOSPCEvidenceClassification(t *testing.T) {
	require.True(t, provider.IsENOSPCEvidence(syscall.ENOSPC, ""))
	require.True(t, provider.IsENOSPCEvidence(errors.New("git: write error: No space left on device"), ""))
	require.True(t, provider.IsENOSPCEvidence(nil, "fatal: no space left on device\n"))
	require.False(t, provider.IsENOSPCEvidence(errors.New("permission denied"), "disk low"))
	require.True(t, provider.StartsRecovery(provider.SetupError("mkdir", syscall.EACCES)))
	require.False(t, provider.StartsRecovery(provider.ErrCapacityUnmeasurable))
	require.False(t, provider.StartsRecovery(nil))
}

// Issue 18 item 15: the stale cleanup covers homes as well as workspaces. A
// per-session home whose wrapper is gone goes once stale; one whose
// wrapper runs stays whatever its age, and so does the workspace it serves.
func TestStaleCleanupCoversHomes(t *testing.T) {
	f := newFixture(t, "")
	ctx := context.Background()
	current := f.workspace(t, "/current", mib, time.Hour)
	for _, key := range []string{"ses-gone", "ses-live"} {
		_, err := f.p.PrepareWorkspace(ctx, f.sb, "/shared", key)
		require.NoError(t, err)
	}
	require.NoError(t, os.WriteFile(filepath.Join(f.p.HomeDir(f.sb, "ses-gone"), "cache"), bytes.Repeat([]byte{1}, 40*mib), 0o644))
	_, err := f.p.Launch(ctx, provider.LaunchSpec{
		Markers: provider.Markers{SandboxID: f.sb, RuntimeKey: "ses-live", InstanceID: "i", Generation: 1},
		Path:    os.Args[0], Env: []string{"HELPER_MODE=sleep"}, Workspace: "/shared",
	})
	require.NoError(t, err)
	for _, d := range []string{f.p.WorkspaceDir(f.sb, "/shared"), f.p.HomeDir(f.sb, "ses-gone"), f.p.HomeDir(f.sb, "ses-live")} {
		require.NoError(t, os.Chtimes(d, f.now.Add(-time.Hour), f.now.Add(-time.Hour)))
	}
	require.Less(t, f.p.Capacity(ctx, f.sb).AvailableBytes, uint64(32*mib), "fixture is below the threshold")

	rep, err := f.admission().Admit(ctx, f.sb, current, false)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Cleaned)
	require.NoDirExists(t, f.p.HomeDir(f.sb, "ses-gone"), "a stale home without its wrapper is cleaned")
	require.DirExists(t, f.p.HomeDir(f.sb, "ses-live"), "a live wrapper's home stays")
	require.DirExists(t, f.p.WorkspaceDir(f.sb, "/shared"), "a live wrapper's workspace stays")
}

// TestReservedQuotaCountsAsUsed (issue 31): the disk other live sandboxes
// may still write within their quotas counts as used, so free space that
// one sandbox could take back is not handed to a new workspace; without
// reservations the same free space admits.
func TestReservedQuotaCountsAsUsed(t *testing.T) {
	f := newFixture(t, "")
	free := New(f.p, Config{ThresholdBytes: 32 * mib, Now: func() time.Time { return f.now }})
	_, err := free.Admit(context.Background(), f.sb, process.WorkspaceName("/new"), false)
	require.NoError(t, err)

	reserved := New(f.p, Config{ThresholdBytes: 32 * mib, Now: func() time.Time { return f.now },
		Reserved: func(except string) uint64 {
			require.Equal(t, f.sb, except, "a sandbox's own quota is not reserved against it")
			return 1 << 40
		}})
	_, err = reserved.Admit(context.Background(), f.sb, process.WorkspaceName("/new"), false)
	require.ErrorIs(t, err, provider.ErrCapacityRejected)
}

// Issue 32 (data after deletion, the other way round): a stale-looking
// workspace and home that a stored route still names (a suspended or
// idle-stopped session: no process serves them) are a session's work and
// are kept; only what no route names goes.
func TestCleanupKeepsWhatAStoredRouteNames(t *testing.T) {
	f := newFixture(t, "")
	current := setupLow(t, f, 6*mib)
	rep, err := f.admission().Admit(context.Background(), f.sb, current, false, process.WorkspaceName("/stale1"))
	require.NoError(t, err)
	require.Equal(t, 1, rep.Cleaned)
	require.Equal(t, 5, rep.Skipped)
	require.DirExists(t, f.p.WorkspaceDir(f.sb, "/stale1"), "a suspended session's workspace stays")
	require.DirExists(t, f.p.HomeDir(f.sb, "/stale1"))
	require.NoDirExists(t, f.p.WorkspaceDir(f.sb, "/stale2"), "what no route names goes")
}
