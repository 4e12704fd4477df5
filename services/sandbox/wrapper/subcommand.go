package wrapper

import "agentplane.dev/services/sandbox/runtime/scripted"

// Subcommand runs `wrapper ...` or `runtime scripted ...`, the two
// subcommands of every binary that can be AGENTPLANE_WRAPPER_BIN (the
// wrapper starts its default runtime as `<own binary> runtime scripted`),
// and reports whether args named one of them.
func Subcommand(args []string) (code int, ok bool) {
	switch {
	case len(args) > 0 && args[0] == "wrapper":
		return Main(args[1:]), true
	case len(args) > 1 && args[0] == "runtime" && args[1] == "scripted":
		return scripted.Main(args[2:]), true
	}
	return 0, false
}
