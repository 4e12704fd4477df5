package grpcserver

import (
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/pkg/apierr"
)

// ReasonMalformedRequest: a request message that does not decode (a
// truncated message, invalid UTF-8 in a string field, a wrong wire type).
const ReasonMalformedRequest = "MALFORMED_REQUEST"

// decodeCodec is the server's codec: protobuf, except that a request that
// fails to decode is not an error here. grpc-go turns any codec error into
// INTERNAL before an interceptor runs, so the call would be neither counted
// in grpc_server_handled_total nor logged, and the client would get no
// ErrorInfo. Instead the message is reset and remembered as malformed; the
// validation stage (after auth) answers INVALID_ARGUMENT with
// MALFORMED_REQUEST, inside the metrics and logging interceptors.
type decodeCodec struct {
	encoding.CodecV2
	malformed sync.Map     // message pointer → decode error text
	pending   atomic.Int64 // entries in malformed: the usual 0 costs no map lookup
}

func newDecodeCodec() *decodeCodec {
	return &decodeCodec{CodecV2: encoding.GetCodecV2(protocodec.Name)}
}

// Unmarshal implements encoding.CodecV2.
func (c *decodeCodec) Unmarshal(data mem.BufferSlice, v any) error {
	err := c.CodecV2.Unmarshal(data, v)
	if err == nil {
		return nil
	}
	m, ok := v.(proto.Message)
	if !ok {
		return err // not a message this server decodes: grpc-go's own error
	}
	proto.Reset(m) // the handler never sees a half-decoded request
	c.pending.Add(1)
	c.malformed.Store(v, err.Error())
	return nil
}

// take reports and forgets whether msg failed to decode, as the status
// the client gets.
func (c *decodeCodec) take(msg any) error {
	if c.pending.Load() == 0 {
		return nil
	}
	text, ok := c.malformed.LoadAndDelete(msg)
	if !ok {
		return nil
	}
	c.pending.Add(-1)
	return apierr.Error(codes.InvalidArgument, ReasonMalformedRequest, "malformed request: "+text.(string))
}
