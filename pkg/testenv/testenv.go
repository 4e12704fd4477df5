// Package testenv says what a test does when a part of the machine it
// needs (a tool, a mount, a pinned agent) is missing.
package testenv

import (
	"os"
	"testing"
)

// Missing ends a test whose component is missing. Under CI=true, where
// .ci/run installs everything, that is a failure; elsewhere the test is
// skipped and says so, never counted as passed.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("missing under CI=true: "+format, args...)
	}
	t.Skipf("SKIPPED, not passed: "+format, args...)
}
