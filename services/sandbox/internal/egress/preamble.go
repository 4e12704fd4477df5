package egress

import (
	"bytes"
	"encoding/base64"
	"errors"
	"strings"
)

// preambleMagic starts the one line a wrapper sends with every runtime
// connection it hands off: which wrapper it is, proven with its launch
// credential (the same proof as its control stream's Hello). The socket is
// reachable from every sandbox of the node, so the proxy learns whose
// policy applies from this line and nothing else.
const preambleMagic = "AGENTPLANE-EGRESS/1"

// maxPreamble bounds the line (ids are at most 64 bytes, the credential is
// short).
const maxPreamble = 1024

// Identity is the wrapper behind an egress connection.
type Identity struct {
	SandboxID, Instance, Credential string
}

var errPreamble = errors.New("egress: bad preamble")

// preambleLine is id's line, newline included.
func preambleLine(id Identity) ([]byte, error) {
	line := preambleMagic + " " + id.SandboxID + " " + id.Instance + " " +
		base64.RawURLEncoding.EncodeToString([]byte(id.Credential)) + "\n"
	if len(line) > maxPreamble || strings.Count(line, " ") != 3 || strings.Count(line, "\n") != 1 {
		return nil, errPreamble
	}
	return []byte(line), nil
}

// parsePreamble reads b, all a handoff carried: exactly one line.
func parsePreamble(b []byte) (Identity, error) {
	line, ok := bytes.CutSuffix(b, []byte("\n"))
	if !ok || len(b) > maxPreamble || bytes.IndexByte(line, '\n') >= 0 {
		return Identity{}, errPreamble
	}
	f := strings.Split(string(line), " ")
	if len(f) != 4 || f[0] != preambleMagic || f[1] == "" || f[2] == "" {
		return Identity{}, errPreamble
	}
	cred, err := base64.RawURLEncoding.DecodeString(f[3])
	if err != nil || len(cred) == 0 {
		return Identity{}, errPreamble
	}
	return Identity{SandboxID: f[1], Instance: f[2], Credential: string(cred)}, nil
}
