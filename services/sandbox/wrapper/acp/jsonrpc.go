package acp

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
)

// maxLine bounds one JSON-RPC message from the agent (session/load replays
// whole histories; a tool result can be large).
const maxLine = 16 << 20

// message is one JSON-RPC 2.0 object: a request (method and id), a
// notification (method, no id) or a response (id, result or error).
type message struct {
	JSONRPC string           `json:"jsonrpc"`
	ID      *json.RawMessage `json:"id,omitempty"`
	Method  string           `json:"method,omitempty"`
	Params  json.RawMessage  `json:"params,omitempty"`
	Result  json.RawMessage  `json:"result,omitempty"`
	Error   *rpcError        `json:"error,omitempty"`
}

type rpcError struct {
	Code    int             `json:"code"`
	Message string          `json:"message"`
	Data    json.RawMessage `json:"data,omitempty"`
}

func (e *rpcError) Error() string { return fmt.Sprintf("agent error %d: %s", e.Code, e.Message) }

// ErrProtocol is a line from the agent that is not a JSON-RPC 2.0 message,
// or a response nobody asked for (a duplicate answer).
var ErrProtocol = errors.New("acp: protocol violation")

// parseMessage decodes and checks one line (fuzzed).
func parseMessage(line []byte) (message, error) {
	var m message
	if err := json.Unmarshal(line, &m); err != nil {
		return message{}, fmt.Errorf("%w: not JSON", ErrProtocol)
	}
	if m.JSONRPC != "2.0" {
		return message{}, fmt.Errorf("%w: not JSON-RPC 2.0", ErrProtocol)
	}
	switch {
	case m.Method != "":
	case m.ID != nil && (m.Result != nil || m.Error != nil):
	default:
		return message{}, fmt.Errorf("%w: neither a call nor a response", ErrProtocol)
	}
	return m, nil
}

// response is what a call gets back.
type response struct {
	result json.RawMessage
	err    error
}

// conn is the client side of a JSON-RPC connection over newline-delimited
// stdio. Calls from the wrapper get integer ids; the agent's own requests
// (session/request_permission, fs/* it should not send) go to onRequest.
type conn struct {
	wmu sync.Mutex
	w   io.Writer

	mu      sync.Mutex
	next    int64
	pending map[int64]chan response
	closed  error
}

func newConn(w io.Writer) *conn { return &conn{w: w, pending: map[int64]chan response{}} }

func (c *conn) write(m message) error {
	m.JSONRPC = "2.0"
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_, err = c.w.Write(append(b, '\n'))
	return err
}

// start sends a request and returns the channel its response arrives on.
func (c *conn) start(method string, params any) (int64, <-chan response, error) {
	raw, err := json.Marshal(params)
	if err != nil {
		return 0, nil, err
	}
	ch := make(chan response, 1)
	c.mu.Lock()
	if c.closed != nil {
		c.mu.Unlock()
		return 0, nil, c.closed
	}
	c.next++
	id := c.next
	c.pending[id] = ch
	c.mu.Unlock()
	idRaw := json.RawMessage(fmt.Sprint(id))
	if err := c.write(message{ID: &idRaw, Method: method, Params: raw}); err != nil {
		c.mu.Lock()
		delete(c.pending, id)
		c.mu.Unlock()
		return 0, nil, err
	}
	return id, ch, nil
}

// forget drops a pending call (its caller gave up); a late answer to it is
// ignored, not a protocol violation.
func (c *conn) forget(id int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.pending[id]; ok {
		c.pending[id] = nil
	}
}

func (c *conn) notify(method string, params any) error {
	raw, err := json.Marshal(params)
	if err != nil {
		return err
	}
	return c.write(message{Method: method, Params: raw})
}

func (c *conn) reply(id *json.RawMessage, result any, rerr *rpcError) error {
	m := message{ID: id, Error: rerr}
	if rerr == nil {
		raw, err := json.Marshal(result)
		if err != nil {
			return err
		}
		m.Result = raw
	}
	return c.write(m)
}

// deliver hands a response to its call; an id that was never asked, or was
// answered already, is a protocol violation.
func (c *conn) deliver(m message) error {
	var id int64
	if err := json.Unmarshal(*m.ID, &id); err != nil {
		return fmt.Errorf("%w: response id %s is not ours", ErrProtocol, string(*m.ID))
	}
	c.mu.Lock()
	ch, ok := c.pending[id]
	delete(c.pending, id)
	c.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: a second or unasked answer to request %d", ErrProtocol, id)
	}
	if ch == nil {
		return nil // the caller gave up on it
	}
	if m.Error != nil {
		ch <- response{err: m.Error}
	} else {
		ch <- response{result: m.Result}
	}
	return nil
}

// close fails every pending call with err.
func (c *conn) close(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed == nil {
		c.closed = err
	}
	for id, ch := range c.pending {
		if ch != nil {
			ch <- response{err: err}
		}
		delete(c.pending, id)
	}
}

func newScanner(r io.Reader) *bufio.Scanner {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	return sc
}
