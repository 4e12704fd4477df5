package proxy

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/services/credential/attestation"
	"agentplane.dev/services/credential/internal/grants"
	"agentplane.dev/services/credential/internal/scope"
)

// An attestation is reused for the same resolution for at most a second,
// then signed afresh, and never before it was signed; another resolution
// gets its own.
func TestAttestationReusedForASecond(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	key := []byte(strings.Repeat("k", 32))
	p, err := New(Config{AttestationKey: key, Now: func() time.Time { return now }})
	require.NoError(t, err)
	res := &grants.Resolved{Member: scope.Member{UserID: "u1", SessionID: "s1"}, SecretDigest: "d1"}
	other := &grants.Resolved{Member: scope.Member{UserID: "u2", SessionID: "s2"}, SecretDigest: "d2"}

	first, err := p.attestation(res)
	require.NoError(t, err)
	now = now.Add(attestationReuse - time.Millisecond)
	again, err := p.attestation(res)
	require.NoError(t, err)
	require.Equal(t, first, again)
	o, err := p.attestation(other)
	require.NoError(t, err)
	c, err := attestation.Verify(key, o, now)
	require.NoError(t, err)
	require.Equal(t, "u2", c.UserID)

	now = now.Add(time.Millisecond)
	fresh, err := p.attestation(res)
	require.NoError(t, err)
	require.NotEqual(t, first, fresh)
	c, err = attestation.Verify(key, fresh, now)
	require.NoError(t, err)
	require.Equal(t, now.UnixMilli(), c.IssuedAt)

	now = now.Add(-time.Millisecond) // the clock went back: fresh is from after now
	back, err := p.attestation(res)
	require.NoError(t, err)
	require.NotEqual(t, fresh, back)
}

// Attestations past reuse are dropped when another is signed, with the
// resolutions they hold: the map follows the handles in use, not every
// handle this process ever served.
func TestAttestationsPastReuseAreDropped(t *testing.T) {
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	p, err := New(Config{AttestationKey: []byte(strings.Repeat("k", 32)), Now: func() time.Time { return now }})
	require.NoError(t, err)
	for i := range 50 {
		_, err := p.attestation(&grants.Resolved{Member: scope.Member{UserID: "u", SessionID: "s" + strconv.Itoa(i)}})
		require.NoError(t, err)
	}
	require.Equal(t, 50, p.att.Len())
	now = now.Add(attestationReuse)
	_, err = p.attestation(&grants.Resolved{Member: scope.Member{UserID: "u", SessionID: "new"}})
	require.NoError(t, err)
	require.Equal(t, 1, p.att.Len())
}
