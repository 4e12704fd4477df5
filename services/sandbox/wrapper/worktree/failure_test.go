package worktree

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A refused push names the remote's reason (the git route's "agentplane:
// ..." text on the [remote rejected] line), not git's closing line: the
// caller of PushWorktree sees why (issue 36 item 4).
func TestPushFailureNamesTheRemotesReason(t *testing.T) {
	out := "To http://127.0.0.1:4000/git/r/org/app.git\n" +
		" ! [remote rejected] HEAD -> agent/x (agentplane: only branches team/bot/* may be pushed)\n" +
		"error: failed to push some refs to 'http://127.0.0.1:4000/git/r/org/app.git'\n"
	f := classifyPush(out)
	require.Equal(t, PushRejected, f.Reason)
	require.Equal(t, "! [remote rejected] HEAD -> agent/x (agentplane: only branches team/bot/* may be pushed)", f.Detail)

	f = classifyPush("fatal: unable to access 'http://127.0.0.1:1/': Failed to connect\n")
	require.Equal(t, PushUnreachable, f.Reason)
	require.Equal(t, "fatal: unable to access 'http://127.0.0.1:1/': Failed to connect", f.Detail, "no rejection line: the last line")
}
