package proxy

import (
	"encoding/json"
	"errors"
	"net/http"
	"unicode"
	"unicode/utf8"

	ingestv1 "agentplane.dev/pkg/gen/agentplane/ingest/v1"
	"agentplane.dev/services/credential/internal/grants"
)

// Limits of the title route.
const (
	maxTitleBody  = 16 << 10
	maxTitleRunes = 256
	// TitleItemID is the id of the session item a title is stored as.
	TitleItemID = "title"
)

// TitleJSON is the body of PUT .../ingest/v1/sessions/{id}/title. Version
// orders titles like any item's version: an older one never replaces a
// newer one, so a runtime's retry is harmless.
type TitleJSON struct {
	Title   string `json:"title"`
	Version uint64 `json:"version"`
}

var errBadTitle = errors.New("title must be 1-256 characters without control characters, version at least 1")

// ValidateTitle checks a title body as the route accepts it.
func ValidateTitle(t TitleJSON) error {
	n := utf8.RuneCountInString(t.Title)
	if t.Version == 0 || n == 0 || n > maxTitleRunes || !utf8.ValidString(t.Title) {
		return errBadTitle
	}
	for _, r := range t.Title {
		if unicode.IsControl(r) {
			return errBadTitle
		}
	}
	return nil
}

// serveTitle stores a runtime session's title as its `session` item with id
// "title" and payload {"title": ...}, under the same network policy as the
// items route (a member root of the handle's scope; v1 or v2 metadata).
func (p *Proxy) serveTitle(w http.ResponseWriter, r *http.Request, res *grants.Resolved, rsid string, meta *ingestv1.ScopeMetadata) {
	var t TitleJSON
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxTitleBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&t); err != nil {
		writeError(w, http.StatusBadRequest, "body is not a JSON title")
		return
	}
	if err := ValidateTitle(t); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	payload, err := json.Marshal(map[string]string{"title": t.Title})
	if err != nil {
		writeError(w, http.StatusInternalServerError, "internal error")
		return
	}
	if err := p.register(r.Context(), res, rsid); err != nil {
		writeGRPCError(w, err)
		return
	}
	p.ingest(w, r, &ingestv1.IngestRequest{RuntimeSessionId: rsid, Scope: meta, Items: []*ingestv1.Item{{
		ItemId: TitleItemID, Type: ingestv1.ItemType_ITEM_TYPE_SESSION, Version: t.Version, Payload: payload,
	}}})
}
