package fence

// GuardPreludeForTest exposes the token check for tests that call the
// script with raw, malformed tokens.
const GuardPreludeForTest = guardPrelude

// QueuedForTest is how many calls wait for the next batch on rdb (over
// every slot of a cluster client).
func QueuedForTest(rdb any) int {
	n := 0
	batchers.Range(func(k, b any) bool {
		if k.(batcherKey).rdb == rdb {
			bt := b.(*batcher)
			bt.mu.Lock()
			n += len(bt.queue)
			bt.mu.Unlock()
		}
		return true
	})
	return n
}

// Lanes is how many batches may be on the wire at once per client.
const Lanes = lanes
