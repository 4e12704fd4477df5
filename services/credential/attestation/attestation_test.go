package attestation

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var key = []byte(strings.Repeat("k", 32))

func TestSignVerify(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	c := Claims{UserID: "u1", SandboxID: "sb", Directory: "/w", SessionID: "s1", HandleKind: "worktree", SecretDigest: "ab"}
	v, err := Sign(key, c, now, 10*time.Second)
	require.NoError(t, err)

	got, err := Verify(key, v, now.Add(time.Second))
	require.NoError(t, err)
	require.Equal(t, "u1", got.UserID)
	require.Equal(t, "ab", got.SecretDigest)
	require.Equal(t, now.Add(10*time.Second).UnixMilli(), got.ExpiresAt)

	_, err = Verify(key, v, now.Add(20*time.Second))
	require.ErrorIs(t, err, ErrInvalid, "expired")
	_, err = Verify(key, v, now.Add(-time.Minute))
	require.ErrorIs(t, err, ErrInvalid, "not yet valid")
	_, err = Verify([]byte(strings.Repeat("x", 32)), v, now)
	require.ErrorIs(t, err, ErrInvalid, "other key")

	parts := strings.Split(v, ".")
	_, err = Verify(key, parts[0]+"."+parts[1]+"x."+parts[2], now)
	require.ErrorIs(t, err, ErrInvalid, "tampered claims")
	_, err = Verify(key, "v1.."+parts[2], now)
	require.ErrorIs(t, err, ErrInvalid)
}

func TestLifetimeCapped(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	v, err := Sign(key, Claims{UserID: "u"}, now, time.Hour)
	require.NoError(t, err)
	c, err := Verify(key, v, now)
	require.NoError(t, err)
	require.LessOrEqual(t, c.ExpiresAt-c.IssuedAt, MaxLifetime.Milliseconds())
	_, err = Sign(key[:10], Claims{}, now, time.Second)
	require.Error(t, err)
}
