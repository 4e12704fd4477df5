package sealer

import (
	"encoding/base64"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSealOpen(t *testing.T) {
	s, err := New(RandomKey())
	require.NoError(t, err)
	sealed := s.Seal([]byte("sk-secret"), "ref-1")
	require.NotContains(t, string(sealed), "sk-secret")
	got, err := s.Open(sealed, "ref-1")
	require.NoError(t, err)
	require.Equal(t, "sk-secret", string(got))

	_, err = s.Open(sealed, "ref-2")
	require.ErrorIs(t, err, ErrOpen, "context binds the ciphertext")
	other, _ := New(RandomKey())
	_, err = other.Open(sealed, "ref-1")
	require.ErrorIs(t, err, ErrOpen)
	_, err = s.Open(sealed[:5], "ref-1")
	require.ErrorIs(t, err, ErrOpen)
}

func TestParseKey(t *testing.T) {
	k := RandomKey()
	for _, e := range []*base64.Encoding{base64.StdEncoding, base64.RawURLEncoding} {
		got, err := ParseKey(e.EncodeToString(k))
		require.NoError(t, err)
		require.Equal(t, k, got)
	}
	_, err := ParseKey(base64.StdEncoding.EncodeToString(k[:16]))
	require.Error(t, err)
	_, err = ParseKey("not base64!")
	require.Error(t, err)
}
