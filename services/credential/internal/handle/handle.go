// Package handle makes and checks the opaque credential handles runtimes
// present to the proxy: a type prefix, 32 random bytes in base64url, and a
// CRC32 checksum, so a mistyped or forged handle is rejected before any
// store read. Only the SHA-256 digest of a handle is ever stored.
package handle

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"hash/crc32"
)

// Kind is the kind of a handle, named by its prefix.
type Kind int

const (
	// Worktree is the canonical handle shared by a worktree scope ("aph_").
	Worktree Kind = iota + 1
	// PerSession is a handle of one session ("aps_").
	PerSession
)

const (
	worktreePrefix   = "aph_"
	perSessionPrefix = "aps_"
	prefixLen        = 4
	bodyBytes        = 32
	bodyLen          = 43 // base64url of 32 bytes, unpadded
	sumLen           = 6  // base64url of a 4-byte CRC32, unpadded
	// Len is the length of every well-formed handle.
	Len = prefixLen + bodyLen + sumLen
)

// ErrMalformed means the text is not a well-formed handle (prefix, length,
// alphabet or checksum). It never carries the text.
var ErrMalformed = errors.New("malformed handle")

var enc = base64.RawURLEncoding.Strict()

// Prefix returns the prefix of kind.
func (k Kind) Prefix() string {
	if k == PerSession {
		return perSessionPrefix
	}
	return worktreePrefix
}

// String names the kind.
func (k Kind) String() string {
	switch k {
	case Worktree:
		return "worktree"
	case PerSession:
		return "per_session"
	}
	return "unknown"
}

// New returns a fresh random handle of kind.
func New(kind Kind) (string, error) {
	if kind != Worktree && kind != PerSession {
		return "", errors.New("handle: unknown kind")
	}
	var body [bodyBytes]byte
	if _, err := rand.Read(body[:]); err != nil {
		return "", err
	}
	s := kind.Prefix() + enc.EncodeToString(body[:])
	return s + checksum(s), nil
}

func checksum(prefixAndBody string) string {
	var sum [4]byte
	binary.BigEndian.PutUint32(sum[:], crc32.ChecksumIEEE([]byte(prefixAndBody)))
	return enc.EncodeToString(sum[:])
}

// Parse checks raw's form and checksum without touching any store and
// returns its kind.
func Parse(raw string) (Kind, error) {
	if len(raw) != Len {
		return 0, ErrMalformed
	}
	var kind Kind
	switch raw[:prefixLen] {
	case worktreePrefix:
		kind = Worktree
	case perSessionPrefix:
		kind = PerSession
	default:
		return 0, ErrMalformed
	}
	body := raw[prefixLen : prefixLen+bodyLen]
	var buf [bodyBytes + 1]byte
	if n, err := enc.Decode(buf[:], []byte(body)); err != nil || n != bodyBytes {
		return 0, ErrMalformed
	}
	want := checksum(raw[:prefixLen+bodyLen])
	if subtle.ConstantTimeCompare([]byte(want), []byte(raw[prefixLen+bodyLen:])) != 1 {
		return 0, ErrMalformed
	}
	return kind, nil
}

// Digest is the SHA-256 of a handle: the only form that is stored.
type Digest [sha256.Size]byte

// DigestOf returns raw's digest.
func DigestOf(raw string) Digest { return sha256.Sum256([]byte(raw)) }

// String is the lowercase hex form used in keys and the Grant message.
func (d Digest) String() string { return hex.EncodeToString(d[:]) }

// ParseDigest reads the hex form.
func ParseDigest(s string) (Digest, error) {
	var d Digest
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != len(d) {
		return d, errors.New("handle: bad digest")
	}
	copy(d[:], b)
	return d, nil
}

// Equal compares two digests in constant time.
func (d Digest) Equal(o Digest) bool { return subtle.ConstantTimeCompare(d[:], o[:]) == 1 }
