package codecheck

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// adapters names, per service, the internal packages that speak
// transport, and why. Every other package under internal/ is domain: it
// must not depend on gRPC or the generated protos, directly or through
// another package. An entry that no longer speaks transport fails the test,
// so the list says what is true.
var adapters = map[string]map[string]string{
	"sandbox": {
		"internal/edge/grpcapi":     "SandboxService and WrapperControlService handlers; the error translator",
		"internal/edge/wrapperconn": "the one converter of wrapper frames (sandboxv1, runtimev1) to and from the driver's",
		"internal/edge/notify":      "the driver's Notifier over SessionNotifyService",
		"internal/edge/credclient":  "the driver's credential port over CredentialService",
	},
	"session": {
		"internal/grpcapi": "SessionService and SessionNotifyService handlers; the error translator",
		"internal/peers":   "the service's ports over the sandbox, credential and ingest services",
	},
	"credential": {
		"internal/grpcapi": "CredentialService handlers; the error translator",
		"internal/proxy":   "the HTTP proxy; it posts captured history to IngestService and maps its status codes to HTTP",
	},
	"ingest": {
		"internal/grpcapi":    "IngestService handlers, limits; the error translator",
		"internal/membership": "asks the credential service about scope membership",
		"internal/store":      "keeps items in their protobuf wire form (ingestv1)",
	},
}

// TestDomainPackagesHaveNoTransport is issue 24's acceptance check, kept:
// `go list -deps ./internal/control/driver` in services/sandbox shows no pkg/gen
// and no google.golang.org/grpc package, and neither does any other
// domain package of any service.
func TestDomainPackagesHaveNoTransport(t *testing.T) {
	root := repoRoot(t)
	for service, allowed := range adapters {
		dir := filepath.Join(root, "services", service)
		crossings, err := TransportCrossings(dir, "./internal/...")
		if err != nil {
			t.Fatal(err)
		}
		module := "agentplane.dev/services/" + service + "/"
		found := map[string]bool{}
		for _, c := range crossings {
			rel := strings.TrimPrefix(c.Package, module)
			found[rel] = true
			if _, ok := allowed[rel]; !ok {
				t.Errorf("%s/%s is a domain package but depends on transport: %s", service, rel, strings.Join(c.Edges, "; "))
			}
		}
		for rel := range allowed {
			if !found[rel] {
				t.Errorf("%s/%s is named an adapter but speaks no transport (or is gone): remove it from adapters", service, rel)
			}
		}
		if service == "sandbox" && found["internal/control/driver"] {
			t.Errorf("the sandbox driver must stay transport-free (issue 24)")
		}
	}
}

// The walk itself: a transport import two steps down is found on the
// package that reaches it, with the edge where it crosses.
func TestCrossingEdges(t *testing.T) {
	imports := map[string][]string{
		"svc/domain":  {"svc/store", "fmt"},
		"svc/store":   {"svc/codec"},
		"svc/codec":   {"agentplane.dev/pkg/gen/agentplane/x/v1", "google.golang.org/grpc/status"},
		"svc/clean":   {"fmt"},
		"svc/adapter": {"google.golang.org/grpc"},
	}
	want := []string{"svc/codec imports agentplane.dev/pkg/gen/agentplane/x/v1", "svc/codec imports google.golang.org/grpc/status"}
	if got := crossingEdges("svc/domain", imports, Transport); !slices.Equal(got, want) {
		t.Errorf("domain: %v, want %v", got, want)
	}
	if got := crossingEdges("svc/clean", imports, Transport); len(got) != 0 {
		t.Errorf("clean: %v, want none", got)
	}
	if got := crossingEdges("svc/adapter", imports, Transport); len(got) != 1 {
		t.Errorf("adapter: %v, want one edge", got)
	}
	for path, want := range map[string]bool{
		"google.golang.org/grpc": true, "google.golang.org/grpc/codes": true, "google.golang.org/grpcx": false,
		"agentplane.dev/pkg/gen/agentplane/sandbox/v1": true, "agentplane.dev/pkg/genx": false, "google.golang.org/protobuf/proto": false,
	} {
		if Transport(path) != want {
			t.Errorf("Transport(%q) = %v, want %v", path, !want, want)
		}
	}
}
