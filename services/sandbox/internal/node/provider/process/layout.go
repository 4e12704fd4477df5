package process

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"strings"
)

// WorkspaceName maps a route's workspace directory (any string, usually an
// absolute path) to one safe path component: a sanitized tail of the path
// for humans plus a short hash of the whole string for uniqueness, e.g.
// "/home/u/repo" → "repo-1a2b3c4d5e6f7a8b". The hash makes distinct
// directories never share a name, and the result never contains a
// separator, "..", or a leading dot.
func WorkspaceName(workspace string) string {
	sum := sha256.Sum256([]byte(workspace))
	tail := filepath.Base(filepath.Clean("/" + workspace))
	var b strings.Builder
	for _, r := range tail {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
		if b.Len() >= 40 {
			break
		}
	}
	clean := strings.TrimLeft(b.String(), ".")
	if clean == "" {
		clean = "ws"
	}
	return clean + "-" + hex.EncodeToString(sum[:8])
}

// validSandboxID reports whether id can be a directory name under the root
// (a leading dot is reserved for the root's own files, such as its sockets).
func validSandboxID(id string) error {
	if id == "" || id[0] == '.' || strings.ContainsAny(id, "/\\\x00") || len(id) > 200 {
		return fmt.Errorf("process provider: invalid sandbox id %q", id)
	}
	return nil
}
