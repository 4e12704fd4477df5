package codecheck

import (
	"path/filepath"
	"strings"
	"testing"
)

// sandboxInternal is the sandbox module's internal tree.
const sandboxInternal = "agentplane.dev/services/sandbox/internal/"

// wrapperShared names the packages of the sandbox module's internal tree
// that the wrapper (everything that runs inside a sandbox: wrapper/...,
// runtime/..., cmd/agentplane-wrapper) may link, and why. Every other one
// runs only on the host (the egress proxy, the driver, the stores, the
// gRPC handlers) and must not ride into every sandbox. An entry the wrapper
// no longer links fails the test, so the list says what is true.
var wrapperShared = map[string]string{
	"agent/agents":          "an agent profile's spec, rendered by the service and read by the wrapper",
	"agent/command":         "running the runtime's process and keeping its stderr tail",
	"node/boundary":         "the agent's nested bubblewrap (NestedArgs, the seccomp filter) and the limits' wire form; the outer boundary is host-side",
	"network/socketrelay":   "the socket relays both sides serve (the directory of Unix sockets, the relay protocol)",
	"network/egresshandoff": "the egress handoff's wire form and the wrapper's half of it",
	"agent/ingestpost":      "posting history to the ingest route of the credential proxy",
	"node/provider":         "the process markers (environment names) a wrapper carries; the process provider itself is host-side",
	"agent/runtimejsonl":    "the runtime frames between the wrapper and its runtime",
}

// hostOnlyModule reports whether an import path outside the sandbox module
// may never be linked into the wrapper: the store client and the metrics
// library run only in the services.
func hostOnlyModule(path string) bool {
	return strings.HasPrefix(path, "github.com/redis/") || strings.HasPrefix(path, "github.com/prometheus/")
}

// TestWrapperLinksNothingHostOnly: the wrapper's packages import, from the
// sandbox module's internal tree, only wrapperShared, and neither Redis nor
// Prometheus, directly or through another package.
func TestWrapperLinksNothingHostOnly(t *testing.T) {
	dir := filepath.Join(repoRoot(t), "services", "sandbox")
	linked := map[string]bool{}
	banned := func(path string) bool {
		if rel, ok := strings.CutPrefix(path, sandboxInternal); ok {
			if _, shared := wrapperShared[rel]; shared {
				linked[rel] = true
				return false
			}
			return true
		}
		return hostOnlyModule(path)
	}
	for _, pattern := range []string{"./wrapper/...", "./runtime/...", "./cmd/agentplane-wrapper"} {
		crossings, err := Crossings(dir, pattern, banned)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range crossings {
			t.Errorf("%s runs inside the sandbox but links host-only code: %s", c.Package, strings.Join(c.Edges, "; "))
		}
	}
	for pkg := range wrapperShared {
		if !linked[pkg] {
			t.Errorf("internal/%s is listed as shared with the wrapper but the wrapper does not link it: remove it from wrapperShared", pkg)
		}
	}
}
