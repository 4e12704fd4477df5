// Package attestation signs and verifies the short-lived statement the
// credential proxy attaches to every upstream request: which user, in which
// worktree scope, with which backing secret (by digest) the request is made.
// Upstreams (the backend, a provider gateway) import Verify and share the
// HMAC key (AGENTPLANE_ATTESTATION_KEY).
//
// Wire form, in the X-Agentplane-Attestation header:
//
//	v1.<base64url(JSON claims)>.<base64url(HMAC-SHA256(key, "v1." + claims part))>
package attestation

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
	"time"
)

// Header is the request header that carries the attestation.
const Header = "X-Agentplane-Attestation"

// MaxLifetime bounds how long an attestation is valid.
const MaxLifetime = 30 * time.Second

// MinKeySize is the shortest accepted HMAC key.
const MinKeySize = 32

// skew tolerates clocks of the proxy and the upstream that disagree a little.
const skew = 5 * time.Second

const version = "v1"

var enc = base64.RawURLEncoding

// ErrInvalid means the attestation is malformed, forged, expired or too
// long-lived.
var ErrInvalid = errors.New("attestation: invalid")

// Claims is what an attestation states.
type Claims struct {
	UserID           string `json:"user"`
	OrgID            string `json:"org,omitempty"`
	SandboxID        string `json:"sandbox"`
	Directory        string `json:"directory"`
	SessionID        string `json:"session"`
	RuntimeSessionID string `json:"runtime_session,omitempty"`
	HandleKind       string `json:"handle_kind"`
	SecretDigest     string `json:"secret_digest"` // hex SHA-256 of the backing secret
	IssuedAt         int64  `json:"iat"`           // unix ms
	ExpiresAt        int64  `json:"exp"`           // unix ms
}

// Sign returns the header value for c, valid from now for lifetime (at most
// MaxLifetime).
func Sign(key []byte, c Claims, now time.Time, lifetime time.Duration) (string, error) {
	if len(key) < MinKeySize {
		return "", errors.New("attestation: key too short")
	}
	if lifetime <= 0 || lifetime > MaxLifetime {
		lifetime = MaxLifetime
	}
	c.IssuedAt = now.UnixMilli()
	c.ExpiresAt = now.Add(lifetime).UnixMilli()
	body, err := json.Marshal(c)
	if err != nil {
		return "", err
	}
	signed := version + "." + enc.EncodeToString(body)
	return signed + "." + enc.EncodeToString(mac(key, signed)), nil
}

func mac(key []byte, signed string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(signed))
	return m.Sum(nil)
}

// Verify checks value's signature with key and its lifetime against now and
// returns the claims.
func Verify(key []byte, value string, now time.Time) (Claims, error) {
	var c Claims
	parts := strings.Split(value, ".")
	if len(parts) != 3 || parts[0] != version || len(key) < MinKeySize {
		return c, ErrInvalid
	}
	sig, err := enc.DecodeString(parts[2])
	if err != nil || !hmac.Equal(sig, mac(key, parts[0]+"."+parts[1])) {
		return c, ErrInvalid
	}
	body, err := enc.DecodeString(parts[1])
	if err != nil || json.Unmarshal(body, &c) != nil {
		return Claims{}, ErrInvalid
	}
	iat, exp := time.UnixMilli(c.IssuedAt), time.UnixMilli(c.ExpiresAt)
	switch {
	case exp.Before(iat) || exp.Sub(iat) > MaxLifetime:
		return Claims{}, ErrInvalid
	case now.Add(skew).Before(iat):
		return Claims{}, ErrInvalid
	case !now.Before(exp.Add(skew)):
		return Claims{}, ErrInvalid
	}
	return c, nil
}
