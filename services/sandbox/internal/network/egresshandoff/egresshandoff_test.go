package egresshandoff

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPreambleRoundTrip(t *testing.T) {
	t.Parallel()
	id := Identity{SandboxID: "sb1", Instance: "i1", Credential: "cred with spaces\nand a newline"}
	line, err := preambleLine(id)
	require.NoError(t, err)
	got, err := Parse(line)
	require.NoError(t, err)
	require.Equal(t, id, got)

	_, err = preambleLine(Identity{SandboxID: "sb 1", Instance: "i1", Credential: "c"})
	require.Error(t, err, "an id with a space would shift the fields")
	for _, bad := range []string{"", "\n", "AGENTPLANE-EGRESS/1 sb i Y3JlZA", "AGENTPLANE-EGRESS/2 sb i Y3JlZA\n",
		"AGENTPLANE-EGRESS/1 sb i !!\n", "AGENTPLANE-EGRESS/1 sb i \n", "AGENTPLANE-EGRESS/1  i Y3JlZA\n", "AGENTPLANE-EGRESS/1 sb i Y3JlZA\nX\n"} {
		_, err := Parse([]byte(bad))
		require.Error(t, err, "%q", bad)
	}
}

// FuzzParse: a line Parse accepts names a sandbox, an instance and a
// credential, and is exactly the line the wrapper would send for them.
func FuzzParse(f *testing.F) {
	f.Add("AGENTPLANE-EGRESS/1 sb i Y3JlZA\n")
	f.Add("AGENTPLANE-EGRESS/1 sb i !!\n")
	f.Fuzz(func(t *testing.T, in string) {
		id, err := Parse([]byte(in))
		if err != nil {
			return
		}
		require.NotEmpty(t, id.SandboxID)
		require.NotEmpty(t, id.Instance)
		require.NotEmpty(t, id.Credential)
		line, err := preambleLine(id)
		require.NoError(t, err)
		require.Equal(t, in, string(line))
	})
}
