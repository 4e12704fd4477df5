package session

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
)

// Usage counts provider tokens as the credential proxy read them from the
// provider's responses (DESIGN.md 5 "Usage and audit").
type Usage struct {
	Input    uint64 `json:"input,omitempty"`
	Output   uint64 `json:"output,omitempty"`
	Cached   uint64 `json:"cached,omitempty"`
	Requests uint64 `json:"requests,omitempty"`
	// Model is the model of the last response that named one.
	Model string `json:"model,omitempty"`
	// CostUSD is the cost of the responses the price table priced.
	CostUSD float64 `json:"cost_usd,omitempty"`
}

// IsZero reports whether no response was counted.
func (u Usage) IsZero() bool { return u == Usage{} }

// Add counts o on top of u.
func (u Usage) Add(o Usage) Usage {
	u.Input += o.Input
	u.Output += o.Output
	u.Cached += o.Cached
	u.Requests += o.Requests
	u.CostUSD += o.CostUSD
	if o.Model != "" {
		u.Model = o.Model
	}
	return u
}

// AddUsage counts one provider response's usage into the session's totals
// and into the usage its next turn outcome carries. It emits no event (a
// stream of requests would flood watchers): the outcome carries the turn's.
// A deleting session counts nothing more.
func (a *Aggregate) AddUsage(u Usage) {
	if a.Session.State == StateDeleting {
		return
	}
	a.Session.Usage = a.Session.Usage.Add(u)
	a.Session.TurnUsage = a.Session.TurnUsage.Add(u)
	a.sessionChanged = true
}

// TakeTurnUsage returns the usage counted since the previous outcome and
// starts the next turn's from zero.
func (a *Aggregate) TakeTurnUsage() Usage {
	u := a.Session.TurnUsage
	if !u.IsZero() {
		a.Session.TurnUsage = Usage{}
		a.sessionChanged = true
	}
	return u
}

// Price is what a model's tokens cost, in US dollars per million tokens.
// Cached prompt tokens cost Cached instead of Input.
type Price struct {
	Input  float64 `json:"input"`
	Output float64 `json:"output"`
	Cached float64 `json:"cached"`
}

// PriceTable prices usage by model name (exact; "*" prices every model
// not named).
type PriceTable map[string]Price

// ParsePriceTable reads SESSION_PRICE_TABLE: a JSON object of model name
// to {"input","output","cached"} (USD per million tokens, ≥ 0). Empty: no
// table.
func ParsePriceTable(s string) (PriceTable, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var t PriceTable
	d := json.NewDecoder(strings.NewReader(s))
	d.DisallowUnknownFields()
	if err := d.Decode(&t); err != nil {
		return nil, fmt.Errorf(`want {"<model>":{"input":<USD per 1M tokens>,"output":…,"cached":…},…}: %w`, err)
	}
	for model, p := range t {
		if model == "" || len(model) > 96 {
			return nil, fmt.Errorf("model %q: 1 to 96 bytes", model)
		}
		for _, v := range []float64{p.Input, p.Output, p.Cached} {
			if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) || v > 1e6 {
				return nil, fmt.Errorf("model %q: prices must be 0 to 1e6 USD per million tokens", model)
			}
		}
	}
	return t, nil
}

// Cost is u's cost in USD, and whether the table prices u's model.
func (t PriceTable) Cost(u Usage) (float64, bool) {
	p, ok := t[u.Model]
	if !ok {
		if p, ok = t["*"]; !ok {
			return 0, false
		}
	}
	cached := min(u.Cached, u.Input)
	return (float64(u.Input-cached)*p.Input + float64(cached)*p.Cached + float64(u.Output)*p.Output) / 1e6, true
}
