package e2e

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	credentialv1 "agentplane.dev/pkg/gen/agentplane/credential/v1"
	"agentplane.dev/pkg/gittest"
	"agentplane.dev/services/sandbox/wrapper/worktree"
)

// BenchmarkWorktreeClone clones a 50 MB repository (incompressible blobs)
// from one git http-backend server, directly with the token and through
// the wrapper's relay and the credential proxy's git route with a handle,
// side by side in one run (docs/benchmarks.md).
func BenchmarkWorktreeClone(b *testing.B) {
	s := startSuite(b)
	token := "ghs_bench" + newSecret()
	g := gittest.Start(b, token)
	const size = 50 << 20
	bigRepo(b, g, "org/big.git", 10, size/10)

	ctx := context.Background()
	sandboxID := "sbx-bench-" + s.run
	var ref, gitRef string
	require.Eventually(b, func() bool {
		r, err := s.cred.PutBackingCredential(ctx, &credentialv1.PutBackingCredentialRequest{SessionId: "s-bench",
			CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()})
		ref = r.GetCredentialRef()
		return err == nil
	}, 30*time.Second, 50*time.Millisecond)
	gr, err := s.cred.PutBackingCredential(ctx, &credentialv1.PutBackingCredentialRequest{SessionId: "s-bench",
		CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: token, RepoUrl: g.RepoURL("org/big.git")})
	require.NoError(b, err)
	gitRef = gr.GetCredentialRef()
	minted, err := s.cred.MintHandle(ctx, &credentialv1.MintHandleRequest{
		Scope:         &credentialv1.Scope{SandboxId: sandboxID, Directory: "/w/bench"},
		Member:        &credentialv1.Member{SessionId: "s-bench", RuntimeSessionId: "rs-bench", UserId: "u", OrgId: "o"},
		CredentialRef: ref, CredentialClass: credentialv1.CredentialClass_CREDENTIAL_CLASS_STATIC,
		Contract: credentialv1.RuntimeContract_RUNTIME_CONTRACT_WORKTREE, FenceToken: 1, AllocationId: "a", GitCredentialRef: gitRef,
	})
	require.NoError(b, err)
	handle := minted.GetHandle()
	proxyURL := strings.TrimRight(s.proxy, "/") + "/s/" + sandboxID

	b.Run("direct", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			dst := filepath.Join(b.TempDir(), "c")
			gittest.Run(b, "", "clone", "-q", g.AuthURL("org/big.git"), dst)
		}
	})
	b.Run("proxy", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			dst := filepath.Join(b.TempDir(), "c")
			_, err := worktree.Prepare(ctx, worktree.Spec{Dir: dst, RepoURL: g.RepoURL("org/big.git"), ProxyURL: proxyURL,
				Handle: func() string { return handle }}, func(string, string) {})
			require.NoError(b, err)
		}
	})
}

// bigRepo creates repository name on g holding blobs files of blobSize
// random (incompressible) bytes each, in one commit on main.
func bigRepo(tb testing.TB, g *gittest.Server, name string, blobs, blobSize int) {
	bare := g.CreateRepo(tb, name, map[string]string{"README.md": "big\n"})
	work := tb.TempDir()
	gittest.Run(tb, "", "clone", "-q", bare, work)
	for i := range blobs {
		blob := make([]byte, blobSize)
		_, _ = rand.Read(blob)
		require.NoError(tb, os.WriteFile(filepath.Join(work, fmt.Sprintf("blob%d.bin", i)), blob, 0o644))
	}
	gittest.Run(tb, work, "add", "-A")
	gittest.Run(tb, work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "big")
	gittest.Run(tb, work, "push", "-q", "origin", "main")
}
