// Command agentplane-wrapper is the in-sandbox wrapper and the built-in
// scripted runtime, without the services: `agentplane-wrapper wrapper ...`
// and `agentplane-wrapper runtime scripted`, the same subcommands as the
// all-in-one binary, so either can be AGENTPLANE_WRAPPER_BIN.
//
// It exists for start-up time. Every cold session starts the wrapper and
// (with the scripted runtime) the runtime as new processes, and a Go
// process first runs the package initialisers of everything linked in:
// the all-in-one binary (about 40 MB, all four services) reached main after
// ~37 ms here, this one (about 18 MB) after ~21 ms.
package main

import (
	"fmt"
	"os"

	"agentplane.dev/services/sandbox/wrapper"
)

const usage = `usage:
  agentplane-wrapper wrapper [flags]     the in-sandbox wrapper (launched by the sandbox service)
  agentplane-wrapper runtime scripted    the built-in scripted agent runtime (launched by the wrapper)
`

func main() {
	if code, ok := wrapper.Subcommand(os.Args[1:]); ok {
		os.Exit(code)
	}
	fmt.Fprint(os.Stderr, usage)
	os.Exit(2)
}
