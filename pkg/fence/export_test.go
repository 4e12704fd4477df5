package fence

// GuardPreludeForTest exposes the token check for tests that call the
// script with raw, malformed tokens.
const GuardPreludeForTest = guardPrelude

// QueuedForTest is how many calls wait for the next batch on rdb.
func QueuedForTest(rdb any) int {
	b, ok := batchers.Load(rdb)
	if !ok {
		return 0
	}
	bt := b.(*batcher)
	bt.mu.Lock()
	defer bt.mu.Unlock()
	return len(bt.queue)
}

// Lanes is how many batches may be on the wire at once per client.
const Lanes = lanes
