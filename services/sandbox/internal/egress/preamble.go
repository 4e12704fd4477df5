package egress

import (
	"bufio"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"strings"

	"agentplane.dev/services/sandbox/internal/relay"
)

// preambleMagic starts the one line a wrapper's egress relay writes on
// every connection before the runtime's bytes: which wrapper it is, proven
// with its launch credential (the same proof as its control stream's
// Hello). The socket is reachable from every sandbox of the node, so the
// proxy learns whose policy applies from this line and nothing else.
const preambleMagic = "AGENTPLANE-EGRESS/1"

// maxPreamble bounds the line (ids are at most 64 bytes, the credential is
// short).
const maxPreamble = 1024

// Identity is the wrapper behind an egress connection.
type Identity struct {
	SandboxID, Instance, Credential string
}

var errPreamble = errors.New("egress: bad preamble")

// WritePreamble writes id's line to w.
func WritePreamble(w io.Writer, id Identity) error {
	line := preambleMagic + " " + id.SandboxID + " " + id.Instance + " " +
		base64.RawURLEncoding.EncodeToString([]byte(id.Credential)) + "\n"
	if len(line) > maxPreamble {
		return errPreamble
	}
	_, err := io.WriteString(w, line)
	return err
}

// ReadPreamble reads the line from br (at most maxPreamble bytes).
func ReadPreamble(br *bufio.Reader) (Identity, error) {
	var b []byte
	for len(b) <= maxPreamble {
		c, err := br.ReadByte()
		if err != nil {
			return Identity{}, errPreamble
		}
		if c == '\n' {
			return parsePreamble(string(b))
		}
		b = append(b, c)
	}
	return Identity{}, errPreamble
}

func parsePreamble(line string) (Identity, error) {
	f := strings.Split(line, " ")
	if len(f) != 4 || f[0] != preambleMagic || f[1] == "" || f[2] == "" {
		return Identity{}, errPreamble
	}
	cred, err := base64.RawURLEncoding.DecodeString(f[3])
	if err != nil || len(cred) == 0 {
		return Identity{}, errPreamble
	}
	return Identity{SandboxID: f[1], Instance: f[2], Credential: string(cred)}, nil
}

// Dialer is the wrapper's dial for its egress relay: a socket of dir (any
// local replica) and the preamble of id.
func Dialer(dir string, id Identity) func() (net.Conn, error) {
	return func() (net.Conn, error) {
		c, err := relay.DialDir(dir)
		if err != nil {
			return nil, err
		}
		if err := WritePreamble(c, id); err != nil {
			_ = c.Close()
			return nil, err
		}
		return c, nil
	}
}
