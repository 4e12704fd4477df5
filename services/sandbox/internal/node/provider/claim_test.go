package provider

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

func TestClaimRoundTrip(t *testing.T) {
	t.Parallel()
	c := Claim{SandboxID: "sb", RuntimeKey: "/work/repo", InstanceID: "wi-1", Generation: 4, Allocation: "al-1", FenceToken: 9, Credential: "aplc_x"}
	var b bytes.Buffer
	if err := WriteClaim(&b, c); err != nil {
		t.Fatal(err)
	}
	got, err := ReadClaim(&b)
	if err != nil || got != c {
		t.Fatalf("got %+v, %v; want %+v", got, err, c)
	}
	if _, err := ReadClaim(strings.NewReader("")); !errors.Is(err, ErrNoClaim) {
		t.Fatalf("empty: %v, want ErrNoClaim", err)
	}
	for _, bad := range []string{"{}\n", `{"sandbox_id":"sb"}` + "\n", "not json\n", `{"sandbox_id":"sb"`, strings.Repeat("x", 9<<10)} {
		if _, err := ReadClaim(strings.NewReader(bad)); err == nil || errors.Is(err, ErrNoClaim) {
			t.Errorf("%.40q: %v, want a refusal", bad, err)
		}
	}
}

// FuzzReadClaim: whatever arrives on the claim descriptor, ReadClaim
// answers a complete claim or an error, never a partial identity.
func FuzzReadClaim(f *testing.F) {
	f.Add([]byte(`{"sandbox_id":"sb","runtime_key":"k","instance_id":"i","allocation":"a","credential":"c"}` + "\n"))
	f.Add([]byte("\n"))
	f.Add([]byte(`{"sandbox_id":"sb","runtime_key":"k","instance_id":"i","allocation":"a","credential":""}` + "\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ReadClaim(bytes.NewReader(b))
		if err == nil && (c.SandboxID == "" || c.RuntimeKey == "" || c.InstanceID == "" || c.Allocation == "" || c.Credential == "") {
			t.Fatalf("partial claim accepted: %+v", c)
		}
	})
}

func TestReadyLine(t *testing.T) {
	t.Parallel()
	var b bytes.Buffer
	if err := WriteReady(&b); err != nil {
		t.Fatal(err)
	}
	if err := ReadReady(&b); err != nil {
		t.Fatal(err)
	}
	if ReadReady(strings.NewReader("")) == nil {
		t.Fatal("closed before it said ready: accepted")
	}
	if ReadReady(strings.NewReader("{\"x\":1}\n")) == nil {
		t.Fatal("not the ready line: accepted")
	}
}
