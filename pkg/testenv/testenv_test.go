package testenv

import (
	"os"
	"os/exec"
	"testing"
)

// Under CI=true a missing component fails the test; elsewhere it skips.
func TestMissingFailsUnderCI(t *testing.T) {
	if os.Getenv("TESTENV_CHILD") == "1" {
		Missing(t, "a component")
		return
	}
	for ci, wantFail := range map[string]bool{"true": true, "": false} {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestMissingFailsUnderCI$", "-test.v")
		cmd.Env = append(os.Environ(), "TESTENV_CHILD=1", "CI="+ci)
		out, err := cmd.CombinedOutput()
		if failed := err != nil; failed != wantFail {
			t.Fatalf("CI=%q: failed=%v, want %v:\n%s", ci, failed, wantFail, out)
		}
	}
}
