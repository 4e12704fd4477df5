// Package server is the session service's public entry: its configuration
// and Run, used by cmd/session and by cmd/agentplane (all services in one
// process).
package server

import (
	"agentplane.dev/pkg/egresspolicy"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"agentplane.dev/pkg/config"
	"agentplane.dev/services/session/internal/session"
)

// Config is the session service's configuration.
type Config struct {
	config.Common

	SandboxAddr    string // SANDBOX_ADDR: required (routes)
	CredentialAddr string // CREDENTIAL_ADDR: empty skips credential storage and release (dev/test)
	IngestAddr     string // INGEST_ADDR: empty skips history deletion (dev/test)

	QueuedTimeout     time.Duration // SESSION_QUEUED_TIMEOUT: queued longer → failed(preparation_timeout)
	AcceptedTimeout   time.Duration // SESSION_ACCEPTED_TIMEOUT: accepted longer → failed(no_outcome)
	QueuedRedrive     time.Duration // SESSION_QUEUED_REDRIVE: queued longer → any replica's sweep drains the session again
	Retention         time.Duration // SESSION_RETENTION: idle sessions older than this are deleted
	SweepInterval     time.Duration // SESSION_SWEEP_INTERVAL
	ReconcileInterval time.Duration // SESSION_RECONCILE_INTERVAL
	DeleteBackoffBase time.Duration // SESSION_DELETE_BACKOFF_BASE
	DeleteBackoffMax  time.Duration // SESSION_DELETE_BACKOFF_MAX
	DeleteLeaseTTL    time.Duration // SESSION_DELETE_LEASE_TTL
	WipeLocatorTTL    time.Duration // SESSION_WIPE_LOCATOR_TTL: how long a deleted session's wipe locator stays
	PeerTimeout       time.Duration // SESSION_PEER_TIMEOUT
	EventCap          int           // SESSION_EVENT_CAP: events kept per session (approximate)
	WatchPoolSize     int           // SESSION_WATCH_POOL_SIZE: Redis connections for WatchSession readers
	WatchBlock        time.Duration // SESSION_WATCH_BLOCK
	ReplicaID         string        // SESSION_REPLICA: this replica's name in leases
	EgressMaxRules    int           // SESSION_EGRESS_MAX_RULES: rules of one session's egress policy
	// SuspendAfter (SESSION_SUSPEND_AFTER) is how long a session's runtime
	// stays up after its last turn ended before it is suspended; 0: never.
	// SuspendAfterProfiles (SESSION_SUSPEND_AFTER_PROFILES,
	// "profile=duration,...") overrides it per agent profile.
	SuspendAfter         time.Duration
	SuspendAfterProfiles string
	// PriceTable (SESSION_PRICE_TABLE) prices provider tokens per model:
	// JSON {"<model>":{"input","output","cached"}} in USD per million
	// tokens; empty: no cost.
	PriceTable string

	// StopLoops, when set (not from the environment), stops the service's
	// loops and drains when it closes while the service goes on serving:
	// agentplane dev closes it as the suite stops, so no drain calls the
	// sandbox service while that one stops and still sends notifications.
	StopLoops <-chan struct{}
}

// DefaultConfig returns the dev defaults (ports from docs/development.md).
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		Common:         config.DefaultCommon("127.0.0.1:7401", "127.0.0.1:9401"),
		SandboxAddr:    "127.0.0.1:7402",
		CredentialAddr: "127.0.0.1:7403",
		IngestAddr:     "127.0.0.1:7404",

		QueuedTimeout:     16*time.Minute + 30*time.Second,
		AcceptedTimeout:   125 * time.Minute,
		QueuedRedrive:     15 * time.Second,
		Retention:         90 * 24 * time.Hour,
		SweepInterval:     10 * time.Second,
		ReconcileInterval: 2 * time.Second,
		DeleteBackoffBase: time.Second,
		DeleteBackoffMax:  time.Minute,
		DeleteLeaseTTL:    30 * time.Second,
		WipeLocatorTTL:    5 * time.Hour,
		PeerTimeout:       5 * time.Second,
		EventCap:          100_000,
		WatchPoolSize:     1024,
		WatchBlock:        5 * time.Second,
		ReplicaID:         fmt.Sprintf("%s-%d", host, os.Getpid()),
		EgressMaxRules:    egresspolicy.DefaultMaxRules,
		SuspendAfter:      2 * time.Minute,
	}
}

// Bind registers every setting on l with c's values as defaults.
func (c *Config) Bind(l *config.Loader) {
	c.Common.Bind(l)
	l.String(&c.SandboxAddr, "SANDBOX_ADDR", c.SandboxAddr, "sandbox service address (required); "+config.PeerAddrHelp)
	l.String(&c.CredentialAddr, "CREDENTIAL_ADDR", c.CredentialAddr, "credential service address; empty skips credential steps (dev only); "+config.PeerAddrHelp)
	l.String(&c.IngestAddr, "INGEST_ADDR", c.IngestAddr, "ingest service address; empty skips history deletion (dev only); "+config.PeerAddrHelp)
	l.Duration(&c.QueuedTimeout, "SESSION_QUEUED_TIMEOUT", c.QueuedTimeout, "queued messages older than this fail with preparation_timeout")
	l.Duration(&c.AcceptedTimeout, "SESSION_ACCEPTED_TIMEOUT", c.AcceptedTimeout, "accepted messages older than this fail with no_outcome")
	l.Duration(&c.QueuedRedrive, "SESSION_QUEUED_REDRIVE", c.QueuedRedrive, "a message queued this long is drained again by any replica's sweep (its replica may have died)")
	l.Duration(&c.Retention, "SESSION_RETENTION", c.Retention, "sessions idle this long are deleted")
	l.Duration(&c.SweepInterval, "SESSION_SWEEP_INTERVAL", c.SweepInterval, "how often backstops and retention run")
	l.Duration(&c.ReconcileInterval, "SESSION_RECONCILE_INTERVAL", c.ReconcileInterval, "how often pending deletions are driven")
	l.Duration(&c.DeleteBackoffBase, "SESSION_DELETE_BACKOFF_BASE", c.DeleteBackoffBase, "first retry delay of a pending deletion")
	l.Duration(&c.DeleteBackoffMax, "SESSION_DELETE_BACKOFF_MAX", c.DeleteBackoffMax, "largest retry delay of a pending deletion")
	l.Duration(&c.DeleteLeaseTTL, "SESSION_DELETE_LEASE_TTL", c.DeleteLeaseTTL, "lease of one deletion attempt")
	l.Duration(&c.WipeLocatorTTL, "SESSION_WIPE_LOCATOR_TTL", c.WipeLocatorTTL, "how long a deleted session's wipe locator stays (the longest grant lifetime plus the longest retry)")
	l.Duration(&c.PeerTimeout, "SESSION_PEER_TIMEOUT", c.PeerTimeout, "bound on every call to a peer service")
	l.Int(&c.EgressMaxRules, "SESSION_EGRESS_MAX_RULES", c.EgressMaxRules, "most rules of one session's egress policy (larger: INVALID_ARGUMENT)")
	l.Int(&c.EventCap, "SESSION_EVENT_CAP", c.EventCap, "events kept per session (approximate trim)")
	l.Int(&c.WatchPoolSize, "SESSION_WATCH_POOL_SIZE", c.WatchPoolSize, "Redis connections reserved for WatchSession readers")
	l.Duration(&c.WatchBlock, "SESSION_WATCH_BLOCK", c.WatchBlock, "how long one WatchSession read blocks")
	l.Duration(&c.SuspendAfter, "SESSION_SUSPEND_AFTER", c.SuspendAfter, "a session's runtime idle this long after its last turn is suspended (0: never; a session's suspend_after overrides it)")
	l.String(&c.PriceTable, "SESSION_PRICE_TABLE", c.PriceTable, `prices of provider tokens per model, JSON {"<model>":{"input":<USD per 1M tokens>,"output":…,"cached":…}} ("*": every other model); empty: usage has no cost`)
	l.String(&c.SuspendAfterProfiles, "SESSION_SUSPEND_AFTER_PROFILES", c.SuspendAfterProfiles, "SESSION_SUSPEND_AFTER per agent profile, as profile=duration,... (e.g. opencode=5m,kilo=0)")
	l.String(&c.ReplicaID, "SESSION_REPLICA", c.ReplicaID, "this replica's name in deletion leases")
}

// Validate checks every setting and names the variable and flag of each bad one.
func (c *Config) Validate() error {
	errs := []error{c.Common.Validate()}
	bad := func(name string, err error) { errs = append(errs, config.ErrorFor(name, err)) }
	errs = append(errs,
		config.CheckPeerAddr("SANDBOX_ADDR", c.SandboxAddr, true),
		config.CheckPeerAddr("CREDENTIAL_ADDR", c.CredentialAddr, false),
		config.CheckPeerAddr("INGEST_ADDR", c.IngestAddr, false))
	positive := map[string]time.Duration{
		"SESSION_QUEUED_TIMEOUT": c.QueuedTimeout, "SESSION_ACCEPTED_TIMEOUT": c.AcceptedTimeout,
		"SESSION_RETENTION": c.Retention, "SESSION_SWEEP_INTERVAL": c.SweepInterval,
		"SESSION_RECONCILE_INTERVAL": c.ReconcileInterval, "SESSION_DELETE_BACKOFF_BASE": c.DeleteBackoffBase,
		"SESSION_DELETE_BACKOFF_MAX": c.DeleteBackoffMax, "SESSION_DELETE_LEASE_TTL": c.DeleteLeaseTTL,
		"SESSION_PEER_TIMEOUT": c.PeerTimeout, "SESSION_WATCH_BLOCK": c.WatchBlock,
		"SESSION_QUEUED_REDRIVE": c.QueuedRedrive, "SESSION_WIPE_LOCATOR_TTL": c.WipeLocatorTTL,
	}
	for _, name := range []string{"SESSION_QUEUED_TIMEOUT", "SESSION_ACCEPTED_TIMEOUT", "SESSION_RETENTION",
		"SESSION_SWEEP_INTERVAL", "SESSION_RECONCILE_INTERVAL", "SESSION_DELETE_BACKOFF_BASE",
		"SESSION_DELETE_BACKOFF_MAX", "SESSION_DELETE_LEASE_TTL", "SESSION_PEER_TIMEOUT", "SESSION_WATCH_BLOCK", "SESSION_QUEUED_REDRIVE", "SESSION_WIPE_LOCATOR_TTL"} {
		if positive[name] <= 0 {
			bad(name, errors.New("must be positive"))
		}
	}
	if c.DeleteBackoffMax < c.DeleteBackoffBase {
		bad("SESSION_DELETE_BACKOFF_MAX", errors.New("must not be below SESSION_DELETE_BACKOFF_BASE"))
	}
	if c.EventCap < 1000 {
		bad("SESSION_EVENT_CAP", errors.New("must be at least 1000"))
	}
	if c.WatchPoolSize < 1 {
		bad("SESSION_WATCH_POOL_SIZE", errors.New("must be positive"))
	}
	if c.ReplicaID == "" {
		bad("SESSION_REPLICA", errors.New("required"))
	}
	if c.EgressMaxRules < 1 || c.EgressMaxRules > egresspolicy.MaxRulesCeiling {
		bad("SESSION_EGRESS_MAX_RULES", fmt.Errorf("want 1 to %d", egresspolicy.MaxRulesCeiling))
	}
	if c.SuspendAfter < 0 || (c.SuspendAfter > 0 && c.SuspendAfter < session.MinSuspendAfter) {
		bad("SESSION_SUSPEND_AFTER", errors.New("0 (never) or at least 1s"))
	}
	if _, err := session.ParseProfileDurations(c.SuspendAfterProfiles); err != nil {
		bad("SESSION_SUSPEND_AFTER_PROFILES", err)
	}
	if _, err := session.ParsePriceTable(c.PriceTable); err != nil {
		bad("SESSION_PRICE_TABLE", err)
	}
	return errors.Join(errs...)
}

// SuspendPolicy is when idle runtimes are suspended (valid after Validate).
func (c *Config) SuspendPolicy() session.SuspendPolicy {
	profiles, _ := session.ParseProfileDurations(c.SuspendAfterProfiles)
	return session.SuspendPolicy{Default: c.SuspendAfter, Profiles: profiles}
}

// Prices is the price table (valid after Validate).
func (c *Config) Prices() session.PriceTable {
	t, _ := session.ParsePriceTable(c.PriceTable)
	return t
}

// LoadConfig reads the configuration from args and the environment and validates it.
func LoadConfig(args []string, lookupEnv func(string) (string, bool)) (Config, error) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("session", flag.ContinueOnError)
	l := config.NewLoader(fs, lookupEnv)
	c.Bind(l)
	if err := l.Parse(args); err != nil {
		return c, err
	}
	return c, c.Validate()
}
