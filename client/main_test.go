package client

import (
	"testing"

	"go.uber.org/goleak"
)

// Watch runs streams for its caller and DeleteSession waits: neither may
// leave a goroutine behind once the caller is done.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
