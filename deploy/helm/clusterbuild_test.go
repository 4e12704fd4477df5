package helm

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestClusterBuildSharesModules: deploy/cluster/build.sh builds the test cluster in the module
// graph of deploy/cluster/go.mod, which requires this module so that every package the chart
// tests compile and the cluster's binaries also compile (k8s.io/api, client-go, gRPC, ...) is
// the same module version, compiled once and shared through the build cache; that sharing is
// part of what keeps the cold CI run within its bound (docs/development.md). A module this
// module's tests build at another version than the cluster's fails here: run `go mod tidy` in
// deploy/cluster (or align the versions in both go.mod files).
func TestClusterBuildSharesModules(t *testing.T) {
	mine := goList(t, ".", "list", "-deps", "-test", "-f", "{{with .Module}}{{.Path}} {{.Version}}{{with .Replace}} {{.Version}}{{end}}{{end}}", "./...")
	theirs := goList(t, "../cluster", "list", "-m", "-f", "{{.Path}} {{.Version}}{{with .Replace}} {{.Version}}{{end}}", "all")
	version := func(lines []string) map[string]string {
		m := map[string]string{}
		for _, l := range lines {
			f := strings.Fields(l)
			if len(f) >= 2 && !strings.HasPrefix(f[0], "agentplane.dev/") {
				m[f[0]] = f[len(f)-1]
			}
		}
		return m
	}
	cluster := version(theirs)
	checked := 0
	for path, v := range version(mine) {
		if cv, ok := cluster[path]; ok {
			checked++
			if cv != v {
				t.Errorf("%s: the chart tests build %s, deploy/cluster builds %s", path, v, cv)
			}
		}
	}
	if checked < 50 {
		t.Fatalf("only %d modules in common with deploy/cluster's graph; the comparison is broken", checked)
	}
}

func goList(t *testing.T, dir string, args ...string) []string {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	out, err := cmd.Output()
	if err != nil {
		msg := err.Error()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			msg += ": " + string(ee.Stderr)
		}
		t.Fatalf("go %s in %s: %s", strings.Join(args, " "), dir, msg)
	}
	return strings.Split(strings.TrimSpace(string(out)), "\n")
}
