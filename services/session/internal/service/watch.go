package service

import (
	"context"

	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

const watchBatch = 256

// Watch sends the session's events after cursor ("" = oldest retained,
// "$" = new events only), replaying stored events first and then waiting
// for new ones, until ctx ends or the session is deleted. Every event is
// sent once, in log order; its Cursor resumes right after it.
func (s *Service) Watch(ctx context.Context, id, cursor string, send func(store.StoredEvent) error) error {
	s.metrics.watching(1)
	defer s.metrics.watching(-1)
	// Watchers end with the service (shutdown), not only with their client.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(s.ctx, cancel)
	defer stop()
	live, err := s.store.Live(ctx, id)
	if err != nil {
		return err
	}
	if !live {
		return session.ErrSessionNotFound
	}
	switch cursor {
	case "":
		cursor = "0-0" // the oldest retained event: nothing to refuse
	case "$":
		if cursor, err = s.store.LastCursor(ctx, id); err != nil {
			return err
		}
	default:
		if err := s.store.CheckCursor(ctx, id, cursor); err != nil {
			return err
		}
	}
	if cursor, err = s.replay(ctx, id, cursor, send); err != nil {
		return err
	}
	// A connection of its own, closed when ctx ends, so a gone client or a
	// shutdown ends the blocked read at once and frees the connection.
	conn, err := s.watch.Open(ctx, id)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer conn.Close()
	for {
		evs, err := conn.Wait(ctx, cursor, watchBatch, s.cfg.WatchBlock)
		if ctx.Err() != nil {
			return nil // the read failed because its connection was closed
		}
		if err != nil {
			return err
		}
		if len(evs) == 0 {
			if live, err := s.store.Live(ctx, id); err != nil {
				return err
			} else if !live {
				return session.ErrSessionNotFound
			}
			continue
		}
		if cursor, err = s.sendConfirmed(ctx, id, cursor, evs, send); err != nil {
			return err
		}
	}
}

// replay sends the stored events after cursor and returns the cursor after
// the last one sent.
func (s *Service) replay(ctx context.Context, id, cursor string, send func(store.StoredEvent) error) (string, error) {
	for {
		evs, err := s.store.EventsAfter(ctx, id, cursor, watchBatch)
		if err != nil {
			return cursor, err
		}
		if cursor, err = s.sendConfirmed(ctx, id, cursor, evs, send); err != nil || len(evs) < watchBatch {
			return cursor, err
		}
	}
}

// sendConfirmed sends a batch of events once the replicas hold them
// (store.ConfirmEvents): under a replication policy a watcher never sees an
// event the master had not yet replicated and a failover then lost
// (TestSentinelFailoverAcks once saw an ACCEPTED state that was not in the
// replay afterwards). It returns the cursor after the last event sent.
func (s *Service) sendConfirmed(ctx context.Context, id, cursor string, evs []store.StoredEvent, send func(store.StoredEvent) error) (string, error) {
	if len(evs) == 0 {
		return cursor, nil
	}
	if err := s.store.ConfirmEvents(ctx, id); err != nil {
		return cursor, err
	}
	for _, e := range evs {
		if err := send(e); err != nil {
			return cursor, err
		}
		cursor = e.Cursor
	}
	return cursor, nil
}
