package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"agentplane.dev/client"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// These examples need a running suite (`go run ./cmd/agentplane dev`), so
// they are compiled but not run; cmd/agentplane/e2e/client_test.go runs the
// same calls against the real services.

func ExampleDial() {
	c, err := client.Dial(client.DefaultAddr,
		client.WithToken("internal-token"), // when the deployment requires one
		// client.WithTLS(nil),              // TLS with the system roots
	)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
}

// A whole turn: create a session, send a message, watch until its outcome.
func ExampleClient_Watch() {
	c, err := client.Dial(client.DefaultAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	s, err := c.CreateSession(ctx, &sessionv1.CreateSessionRequest{
		UserId: "u1", OrgId: "o1",
		Worktree:   &sessionv1.Worktree{Directory: "/work/repo"},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: "sk-..."},
	})
	if err != nil {
		log.Fatal(err)
	}
	m, err := c.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: s.GetSessionId(), Content: "hello"})
	if err != nil {
		log.Fatal(err)
	}
	// From the oldest event: nothing of this new session is missed, and a
	// broken stream is resumed after the last event seen.
	for ev, err := range c.Watch(ctx, s.GetSessionId(), "") {
		if err != nil {
			log.Fatal(err)
		}
		switch {
		case ev.GetRuntimeEvent().GetKind() == runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_MESSAGE_DELTA:
			fmt.Print(ev.GetRuntimeEvent().GetText())
		case ev.GetOutcome().GetLastMessageId() == m.GetMessageId():
			fmt.Println("\n", ev.GetOutcome().GetResult(), ev.GetOutcome().GetSummary())
			return
		}
	}
}

// SendMessage makes the message id when none is given; retrying with the
// returned id (after a crash, say) delivers the message once.
func ExampleClient_SendMessage() {
	c, err := client.Dial(client.DefaultAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	m, err := c.SendMessage(context.Background(), &sessionv1.SendMessageRequest{SessionId: "ses-1", Content: "run the tests"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(m.GetMessageId(), m.GetState())
}

// DeleteSession returns once the deletion is complete, waiting through
// DELETION_PENDING_CLEANUP as long as the context allows.
func ExampleClient_DeleteSession() {
	c, err := client.Dial(client.DefaultAddr, client.WithRetryHook(func(r client.Retry) {
		log.Printf("%s: %s, again in %s", r.Method, client.Reason(r.Err), r.Delay)
	}))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err = c.DeleteSession(ctx, &sessionv1.DeleteSessionRequest{SessionId: "ses-1"})
	switch {
	case err == nil:
		fmt.Println("deleted")
	case client.Reason(err) == client.ReasonDeletionPendingCleanup:
		fmt.Println("still cleaning up; the server carries on without us")
	case client.Reason(err) == client.ReasonSessionNotFound:
		fmt.Println("no such session")
	case errors.Is(err, context.DeadlineExceeded):
		fmt.Println("timed out")
	default:
		log.Fatal(err)
	}
}

func ExampleClient_ListSessions() {
	c, err := client.Dial(client.DefaultAddr)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	for s, err := range c.ListSessions(context.Background(), &sessionv1.ListSessionsRequest{OrgId: "o1"}) {
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(s.GetSessionId(), s.GetState())
	}
}
