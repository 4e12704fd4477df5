package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
)

// DevState is what `agentplane dev` hands to the CLI on the same machine:
// the backing credential of new sessions (dev's --provider-key-file) and
// the internal token, when dev has them. It lives in a file only this user
// can read, named after dev's session port, so no secret is ever on a
// command line or in a log.
type DevState struct {
	PID           int    `json:"pid"`
	Credential    string `json:"credential,omitempty"`
	InternalToken string `json:"internal_token,omitempty"`
}

// DevStateDir is where dev's state files live: $XDG_RUNTIME_DIR/agentplane,
// else a directory of this user's under the temporary directory.
func DevStateDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "agentplane")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("agentplane-%d", os.Getuid()))
}

// DevStatePath is the state file of the dev suite whose session service
// listens on port.
func DevStatePath(port string) string { return filepath.Join(DevStateDir(), "dev-"+port+".json") }

// WriteDevState writes st for the dev suite on port (0600, in a 0700
// directory of this user's).
func WriteDevState(port string, st DevState) (string, error) {
	dir := DevStateDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	if err := ownedPrivate(dir); err != nil {
		return "", err
	}
	b, err := json.Marshal(st)
	if err != nil {
		return "", err
	}
	path := DevStatePath(port)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return "", err
	}
	return path, os.Rename(tmp, path)
}

// readDevState returns the state of the dev suite at addr: only for a
// loopback address, from a file this user owns that no one else can read,
// written by a dev process that still runs.
func readDevState(addr string) (DevState, bool) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return DevState{}, false
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return DevState{}, false
	}
	path := DevStatePath(port)
	if ownedPrivate(filepath.Dir(path)) != nil || ownedPrivate(path) != nil {
		return DevState{}, false
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return DevState{}, false
	}
	var st DevState
	if json.Unmarshal(b, &st) != nil || st.PID <= 0 || syscall.Kill(st.PID, 0) != nil {
		return DevState{}, false
	}
	return st, true
}

// ownedPrivate checks that path belongs to this user and no one else may
// read or write it.
func ownedPrivate(path string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || int(st.Uid) != os.Getuid() || fi.Mode().Perm()&0o077 != 0 || fi.Mode()&os.ModeSymlink != 0 {
		return errors.New(path + ": not private to this user")
	}
	return nil
}
