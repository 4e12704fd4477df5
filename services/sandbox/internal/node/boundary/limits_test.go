package boundary

import (
	"encoding/json"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// limitsHelper applies the limits l (String's form) to itself as a wrapper
// does, then tries to pass them, printing the errno of each attempt.
func limitsHelper(l string) int {
	lim, err := ParseLimits(l)
	if err != nil {
		return 2
	}
	got := map[string]string{"apply": errno(lim.Apply())}
	// Go ignores SIGXFSZ, so the write past RLIMIT_FSIZE fails with EFBIG.
	f, err := os.CreateTemp("", "fsize")
	if err == nil {
		_, err = f.Write(make([]byte, 2*lim.FileSize))
		_ = f.Close()
		_ = os.Remove(f.Name())
	}
	got["write_past_fsize"] = errno(err)
	var r syscall.Rlimit
	_ = syscall.Getrlimit(syscall.RLIMIT_CPU, &r)
	got["cpu_max"] = errno(nil)
	if r.Max != lim.CPUSeconds {
		got["cpu_max"] = "unset"
	}
	got["raise_cpu"] = errno(syscall.Setrlimit(syscall.RLIMIT_CPU, &syscall.Rlimit{Cur: r.Max + 1, Max: r.Max + 1}))
	_ = json.NewEncoder(os.Stdout).Encode(got)
	return 0
}

// TestLimitsBoundFileSizeAndCPU: a sandbox's processes cannot write a file
// past RLIMIT_FSIZE nor raise RLIMIT_CPU (issue 31 item 7: both were
// unlimited).
func TestLimitsBoundFileSizeAndCPU(t *testing.T) {
	self, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(self)
	cmd.Env = []string{"LIMITS_HELPER=" + Limits{FileSize: 1 << 20, CPUSeconds: 3600}.String(), "TMPDIR=" + t.TempDir()}
	out, err := cmd.Output()
	require.NoError(t, err, "%s", exitStderr(err))
	got := map[string]string{}
	require.NoError(t, json.Unmarshal(out, &got), "%s", out)
	require.Equal(t, "ok", got["apply"])
	require.Equal(t, "EFBIG", got["write_past_fsize"], "%v", got)
	require.Equal(t, "ok", got["cpu_max"], "%v", got)
	if os.Geteuid() != 0 {
		require.Equal(t, "EPERM", got["raise_cpu"], "%v", got)
	}
}

// TestDefaultLimitsFitTheFileTable: by default one sandbox holds at most a
// FileTableShare-th of a 24 GiB node's file table (its fs.file-max is
// 2,466,112); issue 31 saw 4096 × 1024 exceed all of it.
func TestDefaultLimitsFitTheFileTable(t *testing.T) {
	require.Empty(t, DefaultLimits.CheckFileTable(2466112))
	require.NotZero(t, DefaultLimits.FileSize, "RLIMIT_FSIZE is set by default")
	require.NotZero(t, DefaultLimits.CPUSeconds, "RLIMIT_CPU is set by default")
	require.NotEmpty(t, Limits{OpenFiles: 4096, Processes: 1024}.CheckFileTable(2466112))
	require.NotEmpty(t, Limits{Processes: 1024}.CheckFileTable(2466112), "unbounded nofile")
}
