package proxy

import (
	"bufio"
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	oidA = "1111111111111111111111111111111111111111"
	oidB = "2222222222222222222222222222222222222222"
	zero = "0000000000000000000000000000000000000000"
)

func TestPushPolicy(t *testing.T) {
	cases := []struct {
		name   string
		prefix string
		cmd    PushCommand
		reason string
	}{
		{"create agent branch", "", PushCommand{zero, oidA, "refs/heads/agent/x"}, ""},
		{"update agent branch", "", PushCommand{oidA, oidB, "refs/heads/agent/x/y"}, ""},
		{"default branch", "", PushCommand{oidA, oidB, "refs/heads/main"}, pushRefDenied},
		{"create other branch", "", PushCommand{zero, oidA, "refs/heads/feature"}, pushRefDenied},
		{"bare prefix", "", PushCommand{zero, oidA, "refs/heads/agent/"}, pushRefDenied},
		{"prefix without slash", "", PushCommand{zero, oidA, "refs/heads/agentx"}, pushRefDenied},
		{"tag", "", PushCommand{zero, oidA, "refs/tags/agent/v1"}, pushRefDenied},
		{"notes", "", PushCommand{zero, oidA, "refs/notes/agent/x"}, pushRefDenied},
		{"unqualified", "", PushCommand{zero, oidA, "agent/x"}, pushRefDenied},
		{"dotdot", "", PushCommand{zero, oidA, "refs/heads/agent/../main"}, pushRefDenied},
		{"dot component", "", PushCommand{zero, oidA, "refs/heads/agent/.x"}, pushRefDenied},
		{"lock", "", PushCommand{zero, oidA, "refs/heads/agent/x.lock"}, pushRefDenied},
		{"reflog syntax", "", PushCommand{zero, oidA, "refs/heads/agent/x@{1}"}, pushRefDenied},
		{"double slash", "", PushCommand{zero, oidA, "refs/heads/agent//x"}, pushRefDenied},
		{"space", "", PushCommand{zero, oidA, "refs/heads/agent/a b"}, pushRefDenied},
		{"delete agent branch", "", PushCommand{oidA, zero, "refs/heads/agent/x"}, pushDeleteDenied},
		{"delete default branch", "", PushCommand{oidA, zero, "refs/heads/main"}, pushDeleteDenied},
		{"own prefix", "bot/", PushCommand{zero, oidA, "refs/heads/bot/x"}, ""},
		{"own prefix refuses agent/", "bot/", PushCommand{zero, oidA, "refs/heads/agent/x"}, pushRefDenied},
		{"nested prefix", "team/bot/", PushCommand{oidA, oidB, "refs/heads/team/bot/x"}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			reason, msg := PushPolicy{BranchPrefix: c.prefix}.Check(c.cmd)
			require.Equal(t, c.reason, reason)
			require.Equal(t, reason == "", msg == "")
		})
	}
}

// pkts frames lines as pkt-lines followed by a flush.
func pkts(lines ...string) []byte {
	var b []byte
	for _, l := range lines {
		b = append(b, pktLine(l)...)
	}
	return append(b, "0000"...)
}

func TestParsePush(t *testing.T) {
	body := append(pkts(
		"shallow "+oidA+"\n",
		zero+" "+oidA+" refs/heads/agent/x\x00report-status side-band-64k push-options agent=git/2.43\n",
		oidA+" "+zero+" refs/heads/old\n",
	), "PACK-the-rest"...)
	br := bufio.NewReader(bytes.NewReader(body))
	req, err := ParsePush(br)
	require.NoError(t, err)
	require.Equal(t, []PushCommand{{zero, oidA, "refs/heads/agent/x"}, {oidA, zero, "refs/heads/old"}}, req.Commands)
	require.True(t, req.Has("report-status") && req.Has("agent") && !req.Has("atomic"))
	rest, _ := bufio.NewReader(br).ReadString(0)
	require.Equal(t, "PACK-the-rest", rest, "the reader is left at the pack")

	for name, b := range map[string][]byte{
		"empty":             nil,
		"flush only":        []byte("0000"),
		"no flush":          pktLine(zero + " " + oidA + " refs/heads/agent/x\x00report-status\n"),
		"short oid":         pkts("00 " + oidA + " refs/heads/x\x00\n"),
		"upper-case oid":    pkts(strings.Repeat("AB", 20) + " " + oidB + " refs/heads/x\x00\n"),
		"no ref":            pkts(zero + " " + oidA + "\x00\n"),
		"both zero":         pkts(zero + " " + zero + " refs/heads/x\x00\n"),
		"bad length":        []byte("zzzz"),
		"delim":             []byte("0001"),
		"truncated payload": []byte("0040" + zero),
		"NUL in later line": pkts(zero+" "+oidA+" refs/heads/a\x00\n", zero+" "+oidA+" refs/heads/b\x00x\n"),
	} {
		_, err := ParsePush(bufio.NewReader(bytes.NewReader(b)))
		require.ErrorIs(t, err, errBadPush, name)
	}
	_, err = ParsePush(bufio.NewReader(bytes.NewReader(pkts("push-cert\x00report-status\n"))))
	require.ErrorIs(t, err, errPushCert)

	many := make([]string, maxPushCommands+1)
	for i := range many {
		many[i] = oidA + " " + oidB + " refs/heads/agent/x\n"
	}
	many[0] = strings.TrimSuffix(many[0], "\n") + "\x00report-status\n"
	_, err = ParsePush(bufio.NewReader(bytes.NewReader(pkts(many...))))
	require.ErrorIs(t, err, errBadPush, "too many commands")
}

func TestRefusalReport(t *testing.T) {
	req := &PushRequest{Commands: []PushCommand{{oidA, oidB, "refs/heads/main"}, {zero, oidA, "refs/heads/agent/x"}}, Caps: []string{"report-status"}}
	got := string(RefusalReport(req, []string{"no", ""}))
	require.Equal(t, "000eunpack ok\n"+
		"0026ng refs/heads/main agentplane: no\n"+
		"0052ng refs/heads/agent/x agentplane: another ref update of this push was refused\n0000", got)
	req.Caps = []string{"report-status", "side-band-64k"}
	band := RefusalReport(req, []string{"no", ""})
	require.Equal(t, "\x01", string(band[4:5]))
	require.True(t, strings.HasSuffix(string(band), "0000"))
	require.Contains(t, string(band), got)
}

// FuzzParsePush: no input panics the parser or makes it read past its
// bounds, and whatever it accepts re-frames to the bytes it consumed.
func FuzzParsePush(f *testing.F) {
	f.Add(pkts(zero + " " + oidA + " refs/heads/agent/x\x00report-status\n"))
	f.Add(pkts("shallow "+oidA+"\n", oidA+" "+zero+" refs/heads/main\x00 side-band-64k\n", oidA+" "+oidB+" refs/heads/a\n"))
	f.Add(pkts("push-cert\x00\n"))
	f.Add([]byte("0000"))
	f.Add([]byte("ffff"))
	f.Fuzz(func(t *testing.T, b []byte) {
		br := bufio.NewReader(bytes.NewReader(b))
		req, err := ParsePush(br)
		if err != nil {
			return
		}
		if len(req.Commands) == 0 || len(req.Commands) > maxPushCommands {
			t.Fatalf("accepted %d commands", len(req.Commands))
		}
		for _, c := range req.Commands {
			if !validOID(c.Old) || !validOID(c.New) || c.Ref == "" {
				t.Fatalf("accepted command %+v", c)
			}
			r, _ := PushPolicy{}.Check(c)
			if r == "" && (c.Delete() || !strings.HasPrefix(c.Ref, "refs/heads/agent/")) {
				t.Fatalf("admitted %+v", c)
			}
		}
		msgs := make([]string, len(req.Commands))
		_ = RefusalReport(req, msgs)
	})
}
