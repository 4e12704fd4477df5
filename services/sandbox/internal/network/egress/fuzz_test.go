package egress

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/egresspolicy"
	"agentplane.dev/services/sandbox/internal/network/egresshandoff"
)

// clientHello is a real ClientHello for sni, as crypto/tls writes it.
func clientHello(t testing.TB, sni string) []byte {
	a, b := net.Pipe()
	go func() {
		_ = tls.Client(a, &tls.Config{ServerName: sni, InsecureSkipVerify: true}).Handshake() //nolint:gosec // never completes
	}()
	_ = b.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 64<<10)
	n, err := b.Read(buf)
	require.NoError(t, err)
	_ = a.Close()
	_ = b.Close()
	return buf[:n]
}

func TestReadClientHello(t *testing.T) {
	h := clientHello(t, "allowed.test")
	sni, raw, err := ReadClientHello(bytes.NewReader(append(append([]byte{}, h...), "after"...)))
	require.NoError(t, err)
	require.Equal(t, "allowed.test", sni)
	require.True(t, bytes.HasPrefix(raw, h), "every byte read is replayed")
	_, _, err = ReadClientHello(strings.NewReader("GET / HTTP/1.1\r\n\r\n"))
	require.ErrorIs(t, err, errNotTLS)
}

// FuzzReadClientHello: whatever the sandbox sends after a CONNECT, the SNI
// parse never panics, reads at most one record's bound, and everything it
// read is a prefix of the input (replayed unchanged upstream).
func FuzzReadClientHello(f *testing.F) {
	f.Add(clientHello(f, "allowed.test"))
	f.Add(clientHello(f, ""))
	f.Add([]byte("\x16\x03\x01\x00\x05hello"))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		sni, raw, err := ReadClientHello(bytes.NewReader(in))
		require.True(t, bytes.HasPrefix(in, raw))
		require.LessOrEqual(t, len(raw), maxClientHello)
		if err != nil {
			require.Empty(t, sni)
		}
	})
}

// FuzzProxyRequest: the preamble a handoff carries and the request line
// and headers the runtime sends are parsed without panicking; an accepted
// destination is a normalized name (never an IP literal) and a valid port.
func FuzzProxyRequest(f *testing.F) {
	f.Add("AGENTPLANE-EGRESS/1 sb i Y3JlZA\nCONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
	f.Add("AGENTPLANE-EGRESS/1 sb i Y3JlZA\nGET http://Allowed.TEST./x HTTP/1.1\r\nHost: a\r\n\r\n")
	f.Add("AGENTPLANE-EGRESS/1 sb i Y3JlZA\nCONNECT [::1]:443 HTTP/1.1\r\n\r\n")
	f.Add("AGENTPLANE-EGRESS/1 sb i Y3JlZA\nCONNECT 127.0.0.1:0 HTTP/1.1\r\n\r\n")
	f.Add("AGENTPLANE-EGRESS/1 sb i !!\nGET https://x/ HTTP/1.1\r\n\r\n")
	f.Fuzz(func(t *testing.T, in string) {
		line, rest, _ := strings.Cut(in, "\n")
		id, err := egresshandoff.Parse([]byte(line + "\n"))
		if err != nil {
			return
		}
		br := bufio.NewReader(strings.NewReader(rest))
		require.NotEmpty(t, id.SandboxID)
		require.NotEmpty(t, id.Credential)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		host, port, reason := target(req)
		if reason != "" {
			return
		}
		require.Empty(t, egresspolicy.CheckPattern(host))
		require.True(t, port >= 1 && port <= 65535)
	})
}
