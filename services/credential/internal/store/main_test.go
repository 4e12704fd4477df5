package store_test

import (
	"os"
	"testing"

	"agentplane.dev/pkg/redistest"
)

// The store suite runs on the Redis topology AGENTPLANE_TEST_REDIS names;
// a Cluster or Sentinel group is shared by the package's tests.
func TestMain(m *testing.M) { os.Exit(redistest.Shared(m).Run()) }
