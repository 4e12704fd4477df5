package grpcapi

import (
	"errors"
	"path"
	"slices"
	"strings"
	"testing"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/services/session/internal/session"
)

// Fuzz targets for every validator of outside input: they must never panic,
// and whatever they accept must satisfy the documented shape.

func FuzzValidateCreate(f *testing.F) {
	f.Add("s1", "u1", "o1", "/work/repo", "https://x/r.git", "sk-1", "", int32(2))
	f.Add("", "u", "o", "/work/../etc", "", "k", "sbx-1", int32(1))
	f.Add("a/b", "", "o", "relative", "\x00", "", "", int32(0))
	f.Add("s", "u", "o", "/a//b", "", "k\n", "", int32(3))
	f.Fuzz(func(t *testing.T, id, user, org, dir, repo, secret, sandbox string, class int32) {
		r := &sessionv1.CreateSessionRequest{SessionId: id, UserId: user, OrgId: org,
			Worktree:   &sessionv1.Worktree{Directory: dir, RepoUrl: repo},
			Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass(class), Secret: secret},
			SandboxId:  sandbox}
		err := validateCreate(r)
		if err != nil {
			var inv *session.InvalidError
			if !errors.As(err, &inv) || len(inv.Violations) == 0 {
				t.Fatalf("not an InvalidError with violations: %v", err)
			}
			if secret != "" && strings.Contains(err.Error(), secret) && len(secret) > 3 {
				t.Fatalf("error echoes the secret")
			}
			return
		}
		if !strings.HasPrefix(dir, "/") || path.Clean(dir) != dir || slices.Contains(strings.Split(dir, "/"), "..") ||
			strings.ContainsFunc(dir, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			t.Fatalf("accepted directory %q", dir)
		}
		if len(session.CheckID("user_id", user)) != 0 || len(session.CheckID("org_id", org)) != 0 {
			t.Fatalf("accepted ids %q %q", user, org)
		}
	})
}

func FuzzValidateSend(f *testing.F) {
	f.Add("s1", "m1", "hello")
	f.Add("", "m", "")
	f.Add("s", strings.Repeat("m", 65), "\xff")
	f.Fuzz(func(t *testing.T, sid, mid, content string) {
		err := validateSend(&sessionv1.SendMessageRequest{SessionId: sid, MessageId: mid, Content: content})
		if err == nil && (content == "" || len(content) > session.MaxContentBytes || len(mid) > 64 || sid == "") {
			t.Fatalf("accepted %q %q (%d bytes)", sid, mid, len(content))
		}
	})
}

func FuzzValidateListAndWatch(f *testing.F) {
	f.Add("o1", "u1", int32(10), "", "")
	f.Add("o1", "", int32(-1), "!!", "x-1")
	f.Add("o1", "", int32(0), "MDAwMDAwMDAwMDAwMDAwMDpz", "1-2")
	f.Add("o", "", int32(501), "", "$")
	f.Fuzz(func(t *testing.T, org, user string, size int32, token, cursor string) {
		c, err := validateList(&sessionv1.ListSessionsRequest{OrgId: org, UserId: user, PageSize: size, PageToken: token})
		if err == nil && (size < 0 || size > 500 || (token != "" && c == "")) {
			t.Fatalf("accepted size %d token %q", size, token)
		}
		_, _ = validateListMessages(&sessionv1.ListMessagesRequest{SessionId: org, PageSize: size, PageToken: token})
		werr := validateWatch(&sessionv1.WatchSessionRequest{SessionId: "s1", Cursor: cursor})
		if werr == nil && cursor != "" && cursor != "$" && !strings.Contains(cursor, "-") {
			t.Fatalf("accepted cursor %q", cursor)
		}
	})
}
