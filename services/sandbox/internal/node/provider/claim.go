package provider

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Identity is who a launched wrapper is, beyond its markers: the
// allocation and owner fencing token it was launched under, and its launch
// credential (a secret: it travels on a descriptor, never argv or environ).
type Identity struct {
	Allocation string
	FenceToken uint64
	Credential string
}

// Claim is what a pooled wrapper waits for on its claim descriptor: the
// identity of the runtime key it now serves (DESIGN.md 3.8). A pooled
// wrapper was started bound to no sandbox; until a claim arrives it talks
// to no service, and when the descriptor closes without one (the service
// destroyed the pooled sandbox, or died) it stops its runtime and exits.
type Claim struct {
	SandboxID  string `json:"sandbox_id"`
	RuntimeKey string `json:"runtime_key"`
	InstanceID string `json:"instance_id"`
	Generation uint64 `json:"generation"`
	Allocation string `json:"allocation"`
	FenceToken uint64 `json:"fence_token"`
	Credential string `json:"credential"`
}

// ready is the one line a pooled wrapper writes on its claim descriptor
// once it runs inside its boundary with its runtime started: every mount
// of its sandbox is made, so its directories may be renamed into a
// claiming sandbox's tree. Until then no claim takes it.
const ready = "ready\n"

// WriteReady says a pooled wrapper is ready for a claim.
func WriteReady(w io.Writer) error {
	_, err := io.WriteString(w, ready)
	return err
}

// ReadReady waits for a pooled wrapper's ready line; an error when the
// descriptor closed first (the wrapper ended) or carried anything else.
func ReadReady(r io.Reader) error {
	b := make([]byte, len(ready))
	if _, err := io.ReadFull(r, b); err != nil {
		return fmt.Errorf("read ready: %w", err)
	}
	if string(b) != ready {
		return errors.New("read ready: not the ready line")
	}
	return nil
}

// maxClaim bounds what a pooled wrapper reads as its claim.
const maxClaim = 8 << 10

// WriteClaim writes c as one line.
func WriteClaim(w io.Writer, c Claim) error {
	b, err := json.Marshal(c)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// ErrNoClaim: the claim descriptor closed without a claim.
var ErrNoClaim = errors.New("provider: the pool closed the claim descriptor without a claim")

// ReadClaim reads one claim line; every identity field must be set.
func ReadClaim(r io.Reader) (Claim, error) {
	line, err := bufio.NewReaderSize(io.LimitReader(r, maxClaim), maxClaim).ReadBytes('\n')
	if errors.Is(err, io.EOF) && len(line) == 0 {
		return Claim{}, ErrNoClaim
	}
	if err != nil {
		return Claim{}, fmt.Errorf("read claim: %w", err)
	}
	var c Claim
	if err := json.Unmarshal(line, &c); err != nil {
		return Claim{}, fmt.Errorf("parse claim: %w", err)
	}
	if c.SandboxID == "" || c.RuntimeKey == "" || c.InstanceID == "" || c.Allocation == "" || c.Credential == "" {
		return Claim{}, errors.New("claim: sandbox, runtime key, instance, allocation and credential are required")
	}
	return c, nil
}

// Markers of the claim.
func (c Claim) Markers() Markers {
	return Markers{SandboxID: c.SandboxID, RuntimeKey: c.RuntimeKey, InstanceID: c.InstanceID, Generation: c.Generation}
}

// PoolMiss says why a launch of a pooled shape did not take a pooled
// wrapper.
type PoolMiss string

const (
	MissEmpty    PoolMiss = "empty"     // no pooled wrapper of the shape was waiting
	MissStarting PoolMiss = "starting"  // pooled wrappers of the shape were still starting
	MissNotFresh PoolMiss = "not_fresh" // the runtime key has a workspace or home already (a resume)
	MissClaim    PoolMiss = "claim"     // the claim failed; the wrapper was destroyed and a cold launch ran
)

// PoolObserver hears of each launch of a pooled shape (label names the
// shape, as the pool was filled).
type PoolObserver interface {
	Claimed(label string)
	Missed(label string, why PoolMiss)
}

// PoolCount is how many pooled wrappers of a label wait for a claim
// (Ready) and how many are still starting (not yet claimable).
type PoolCount struct{ Ready, Starting int }

// Pool is implemented by providers that keep a warm pool (DESIGN.md 3.8).
type Pool interface {
	// FillPool starts one pooled wrapper of spec's shape for launches of
	// spec.Workspace (spec's markers and identity are its own).
	FillPool(ctx context.Context, label string, spec LaunchSpec) error
	// PoolSize counts the pooled wrappers by label.
	PoolSize() map[string]PoolCount
	// SweepPool removes what an earlier incarnation's pool left (its
	// wrappers ended with it; a live one is another replica's and stays).
	SweepPool(ctx context.Context) error
	// DrainPool ends every idle pooled wrapper.
	DrainPool(ctx context.Context)
	SetPoolObserver(o PoolObserver)
}
