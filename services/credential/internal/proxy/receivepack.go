package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// A git-receive-pack request (git's pack protocol, "Pushing data to a
// server") starts with its ref-update commands as pkt-lines:
//
//	*shallow ( command-list | push-cert )
//	command-list = PKT-LINE(old SP new SP refname NUL capabilities) *PKT-LINE(old SP new SP refname) flush-pkt
//
// then, when asked for, push options (pkt-lines up to a flush), then the
// packfile (raw bytes, absent when every command is a delete). The route
// reads only the commands, checks them against the push policy, and
// forwards the bytes it read followed by the rest of the body unchanged.

// Bounds of what the route reads before forwarding: a push of more
// commands than this is refused, not read further.
const (
	maxPushCommands     = 1000
	maxPushCommandBytes = 1 << 20
	maxPktLen           = 65520 // git's LARGE_PACKET_MAX
)

// PushCommand is one ref update.
type PushCommand struct {
	Old, New, Ref string
}

// Delete reports whether c deletes its ref (a new id of zeros).
func (c PushCommand) Delete() bool { return zeroOID(c.New) }

// Create reports whether c creates its ref (an old id of zeros).
func (c PushCommand) Create() bool { return zeroOID(c.Old) }

// PushRequest is the parsed command section of a receive-pack request.
type PushRequest struct {
	Commands []PushCommand
	Caps     []string
}

// Has reports whether the client asked for capability name.
func (r *PushRequest) Has(name string) bool {
	for _, c := range r.Caps {
		if c == name || strings.HasPrefix(c, name+"=") {
			return true
		}
	}
	return false
}

// errBadPush: the command section is not what git sends.
var errBadPush = errors.New("malformed receive-pack commands")

// errPushCert: a signed push; the route does not read certificates.
var errPushCert = errors.New("signed pushes are not admitted")

// readPktLine reads one pkt-line: its payload, or flush (nil, true).
func readPktLine(r io.Reader) (payload []byte, flush bool, err error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, false, errBadPush
	}
	n, err := strconv.ParseUint(string(hdr[:]), 16, 16)
	if err != nil {
		return nil, false, errBadPush
	}
	switch {
	case n == 0:
		return nil, true, nil
	case n < 4 || n > maxPktLen:
		return nil, false, errBadPush // delim (1) and response-end (2) are not in a push
	}
	payload = make([]byte, n-4)
	if _, err := io.ReadFull(r, payload); err != nil {
		return nil, false, errBadPush
	}
	return payload, false, nil
}

// ParsePush reads the command section from r (up to and including its
// flush, nothing past it) and returns the commands and the first line's
// capabilities. It reads at most maxPushCommands command lines and
// maxPushCommandBytes.
func ParsePush(r io.Reader) (*PushRequest, error) {
	r = io.LimitReader(r, maxPushCommandBytes)
	req := &PushRequest{}
	first := true
	for {
		line, flush, err := readPktLine(r)
		if err != nil {
			return nil, err
		}
		if flush {
			if first {
				return nil, errBadPush // no command at all
			}
			return req, nil
		}
		line = bytes.TrimSuffix(line, []byte("\n"))
		if first && bytes.HasPrefix(line, []byte("shallow ")) {
			if !validOID(string(line[len("shallow "):])) {
				return nil, errBadPush
			}
			continue
		}
		if first && bytes.HasPrefix(line, []byte("push-cert")) {
			return nil, errPushCert
		}
		if first {
			cmd, caps, _ := bytes.Cut(line, []byte{0})
			line = cmd
			req.Caps = strings.Fields(string(caps))
		} else if bytes.IndexByte(line, 0) >= 0 {
			return nil, errBadPush
		}
		c, err := parseCommand(string(line))
		if err != nil {
			return nil, err
		}
		if len(req.Commands) == maxPushCommands {
			return nil, fmt.Errorf("%w: more than %d ref updates", errBadPush, maxPushCommands)
		}
		req.Commands = append(req.Commands, c)
		first = false
	}
}

func parseCommand(s string) (PushCommand, error) {
	f := strings.SplitN(s, " ", 3)
	if len(f) != 3 || !validOID(f[0]) || !validOID(f[1]) || len(f[0]) != len(f[1]) || f[2] == "" {
		return PushCommand{}, errBadPush
	}
	if zeroOID(f[0]) && zeroOID(f[1]) {
		return PushCommand{}, errBadPush
	}
	return PushCommand{Old: f[0], New: f[1], Ref: f[2]}, nil
}

// validOID: a SHA-1 or SHA-256 object id in lower-case hex.
func validOID(s string) bool {
	if len(s) != 40 && len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

func zeroOID(s string) bool { return strings.Trim(s, "0") == "" }

// pktLine frames payload as one pkt-line.
func pktLine(payload string) []byte {
	return fmt.Appendf(nil, "%04x%s", len(payload)+4, payload)
}

// RefusalReport is the response body of a refused push, as receive-pack
// answers: report-status ("unpack ok", then "ng <ref> <reason>" for each
// command, then a flush), wrapped in side-band channel 1 when the client
// asked for a side band. reasons holds each command's refusal ("": the
// command was allowed but the push is refused as a whole).
func RefusalReport(req *PushRequest, reasons []string) []byte {
	var rep []byte
	rep = append(rep, pktLine("unpack ok\n")...)
	for i, c := range req.Commands {
		why := reasons[i]
		if why == "" {
			why = "another ref update of this push was refused"
		}
		rep = append(rep, pktLine("ng "+c.Ref+" agentplane: "+why+"\n")...)
	}
	rep = append(rep, "0000"...)
	if !req.Has("side-band-64k") && !req.Has("side-band") {
		return rep
	}
	// One band-1 packet per chunk of the report, then a flush.
	max := 65515
	if !req.Has("side-band-64k") {
		max = 995
	}
	var out []byte
	for len(rep) > 0 {
		n := min(len(rep), max)
		out = append(out, pktLine("\x01"+string(rep[:n]))...)
		rep = rep[n:]
	}
	return append(out, "0000"...)
}
