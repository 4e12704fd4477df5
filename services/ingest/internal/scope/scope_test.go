package scope

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// members is a MemberChecker over a fixed set of live (sandbox, directory, runtime session),
// every one of tenant alice (org o1) but "m", mallory's (org o2).
type members struct {
	live  map[[3]string]bool
	err   error
	asked []string
}

var alice, mallory = Tenant{Org: "o1", User: "alice"}, Tenant{Org: "o2", User: "mallory"}

func (m *members) IsLiveMember(_ context.Context, sandbox, dir, rs string, t Tenant) (bool, error) {
	m.asked = append(m.asked, rs)
	owner := alice
	if rs == "m" {
		owner = mallory
	}
	return m.live[[3]string{sandbox, dir, rs}] && t == owner, m.err
}

func TestAdmit(t *testing.T) {
	live := map[[3]string]bool{{"sbx", "/w", "a"}: true, {"sbx", "/w", "b"}: true, {"sbx", "/x", "c"}: true, {"sbx", "/w", "m"}: true}
	v2 := func(sandbox, dir, resolving string) Metadata {
		t := alice
		if resolving == "m" {
			t = mallory
		}
		return Metadata{V2: &V2{SandboxID: sandbox, Directory: dir, ResolvingRuntimeSessionID: resolving, Tenant: t}}
	}
	tests := []struct {
		name   string
		md     Metadata
		target string
		want   error
		asked  []string
	}{
		{"internal call", Metadata{}, "anything", nil, nil},
		{"v1 own", Metadata{V1: &V1{RuntimeSessionID: "a"}}, "a", nil, nil},
		{"v1 other", Metadata{V1: &V1{RuntimeSessionID: "a"}}, "b", ErrMismatch, nil},
		{"v2 sibling", v2("sbx", "/w", "a"), "b", nil, []string{"a", "b"}},
		{"v2 own root asks once", v2("sbx", "/w", "a"), "a", nil, []string{"a"}},
		{"v2 other scope's member", v2("sbx", "/w", "a"), "c", ErrMismatch, []string{"a", "c"}},
		{"v2 other sandbox", v2("sbx2", "/w", "a"), "b", ErrMismatch, []string{"a"}},
		{"v2 resolving member gone", v2("sbx", "/w", "gone"), "b", ErrMismatch, []string{"gone"}},
		{"v2 deleted member's root", v2("sbx", "/w", "a"), "gone", ErrMismatch, []string{"a", "gone"}},
		{"v2 another tenant's member", v2("sbx", "/w", "a"), "m", ErrMismatch, []string{"a", "m"}},
		{"v2 from another tenant's member", v2("sbx", "/w", "m"), "a", ErrMismatch, []string{"m", "a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := &members{live: live}
			err := Admitter{Members: m}.Admit(context.Background(), tt.md, tt.target)
			if tt.want == nil {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, tt.want)
			}
			require.Equal(t, tt.asked, m.asked)
		})
	}
}

func TestAdmitUnavailableIsNeverAdmission(t *testing.T) {
	m := &members{live: map[[3]string]bool{{"sbx", "/w", "a"}: true}, err: errors.New("connection refused")}
	err := Admitter{Members: m}.Admit(context.Background(), Metadata{V2: &V2{SandboxID: "sbx", Directory: "/w", ResolvingRuntimeSessionID: "a", Tenant: alice}}, "a")
	require.ErrorIs(t, err, ErrUnavailable)
	require.NotErrorIs(t, err, ErrMismatch)
}
