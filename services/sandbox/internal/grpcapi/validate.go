package grpcapi

import (
	"path"
	"strings"
	"unicode/utf8"

	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
)

const maxID = 128

// validID accepts the ids the session service issues: 1..128 bytes of
// letters, digits and -_.:; never braces (they are Redis hash tags).
func validID(s string) bool {
	if s == "" || len(s) > maxID {
		return false
	}
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.', r == ':':
		default:
			return false
		}
	}
	return true
}

// validDirectory accepts an absolute, normalized path.
func validDirectory(d string) bool {
	return len(d) <= 4096 && utf8.ValidString(d) && strings.HasPrefix(d, "/") && path.Clean(d) == d &&
		!strings.ContainsAny(d, "\x00\\")
}

type violations []apierr.Option

func (v *violations) check(ok bool, field, desc string) {
	if !ok {
		*v = append(*v, apierr.FieldViolation(field, desc))
	}
}

func (v violations) err(msg string) error {
	if len(v) == 0 {
		return nil
	}
	return apierr.Error(codes.InvalidArgument, ReasonInvalidRoute, msg, v...)
}
