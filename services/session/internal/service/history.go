package service

import (
	"context"
	"errors"
	"strconv"
	"strings"

	"agentplane.dev/pkg/paging"
	"agentplane.dev/services/session/internal/session"
)

// HistoryItem is one history item of a session: the runtime session it was
// recorded under and the item as ingest stores it (an encoded
// agentplane.ingest.v1.Item, so this package needs no ingest types).
type HistoryItem struct {
	RuntimeSessionID string
	Item             []byte
}

// HistoryPage is one page of one runtime session's history.
type HistoryPage struct {
	Items [][]byte // encoded agentplane.ingest.v1.Item, in order
	Next  string   // ingest's next page token; "" on the last page
}

// ErrHistoryGone: ingest holds no history of the runtime session (never
// written, or tombstoned); an export skips it.
var ErrHistoryGone = errors.New("no history of the runtime session")

// ExportHistory pages a session's whole history: every runtime session the
// route ever had, in the order the session recorded them (a re-prepared
// route after a loss or an idle stop got a new one), each in ingest's
// order. The token is "<index of the runtime session>:<ingest's token>".
func (s *Service) ExportHistory(ctx context.Context, id, token string, size int) ([]HistoryItem, string, error) {
	if s.history == nil {
		return nil, "", session.ErrPeerUnavailable
	}
	sess, err := s.store.Get(ctx, id)
	if err != nil {
		return nil, "", err
	}
	if in, err := s.store.Intent(ctx, id); err != nil {
		return nil, "", err
	} else if in != nil {
		return nil, "", session.ErrSessionNotFound
	}
	ids := (&session.DeletionIntent{RuntimeSessionIDs: sess.RuntimeSessionIDs, RuntimeSessionID: sess.Route.RuntimeSessionID}).HistoryIDs()
	at, page, err := parseHistoryToken(token, len(ids))
	if err != nil {
		return nil, "", err
	}
	var out []HistoryItem
	for at < len(ids) && len(out) < size {
		pctx, cancel := s.peerCtx(ctx)
		// ingest pages at most paging.MaxPageSize (500) a call, the
		// API up to 1000: a larger page takes more calls.
		p, err := s.history.Export(pctx, ids[at], page, min(size-len(out), paging.MaxPageSize))
		cancel()
		if err != nil && !errors.Is(err, ErrHistoryGone) {
			return nil, "", err
		}
		for _, it := range p.Items {
			out = append(out, HistoryItem{RuntimeSessionID: ids[at], Item: it})
		}
		if page = p.Next; page == "" {
			at++
		}
	}
	if at >= len(ids) {
		return out, "", nil
	}
	return out, strconv.Itoa(at) + ":" + page, nil
}

func parseHistoryToken(token string, n int) (int, string, error) {
	if token == "" {
		return 0, "", nil
	}
	idx, page, ok := strings.Cut(token, ":")
	at, err := strconv.Atoi(idx)
	if !ok || err != nil || at < 0 || at >= n {
		return 0, "", session.ErrInvalidPageToken
	}
	return at, page, nil
}
