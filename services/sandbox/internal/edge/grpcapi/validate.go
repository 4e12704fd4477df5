package grpcapi

import (
	"google.golang.org/grpc/codes"

	"agentplane.dev/pkg/apierr"
	"agentplane.dev/pkg/ident"
)

// validID accepts the ids every API accepts (pkg/ident): 1..64 of letters, digits, '-'
// and '_'; never "..", a '/', or braces (they are Redis hash tags).
func validID(s string) bool { return ident.ID(s) == "" }

// idRule is the field violation text of a bad id.
const idRule = "1-64 of [A-Za-z0-9_-]"

// validDirectory accepts an absolute, normalized path (pkg/ident).
func validDirectory(d string) bool { return ident.Directory(d) == "" }

type violations []apierr.Option

func (v *violations) check(ok bool, field, desc string) {
	if !ok {
		*v = append(*v, apierr.FieldViolation(field, desc))
	}
}

// why records a violation when the pkg/ident check says what is wrong.
func (v *violations) why(field, why string) { v.check(why == "", field, why) }

func (v violations) err(msg string) error {
	if len(v) == 0 {
		return nil
	}
	return apierr.Error(codes.InvalidArgument, ReasonInvalidRoute, msg, v...)
}
