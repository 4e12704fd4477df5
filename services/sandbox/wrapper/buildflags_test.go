package wrapper

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// The image builds the wrapper with BuildFlags: the memory measured with the
// e2e suite's build is the deployed binary's.
func TestImageBuildsTheWrapperWithBuildFlags(t *testing.T) {
	t.Parallel()
	docker, err := os.ReadFile("../../../Dockerfile")
	require.NoError(t, err)
	want := `go build -tags grpcnotrace -ldflags "-s -w" -o /out/agentplane-wrapper ./services/sandbox/cmd/agentplane-wrapper`
	require.Equal(t, []string{"-tags", "grpcnotrace", "-ldflags", "-s -w"}, BuildFlags)
	require.Contains(t, string(docker), want, "the Dockerfile builds the wrapper so")
}
