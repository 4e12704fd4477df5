package grpcapi

// maxSandboxID bounds a sandbox id (the session service issues 20 bytes).
const maxSandboxID = 64

// sandboxIDRule is the field-violation text of a refused sandbox id.
const sandboxIDRule = "1-64 of [A-Za-z0-9_-]"

// validSandboxID accepts the sandbox ids the session service issues and
// validates: letters, digits, '-' and '_'. Nothing else: a ':' or '/' could
// shape the id like another key or fence resource ("cs:<scope>", "ses/<id>"),
// a '.' like a relative path ("..") under the sandbox root, and braces are
// Redis hash tags.
func validSandboxID(s string) bool {
	if s == "" || len(s) > maxSandboxID {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}
