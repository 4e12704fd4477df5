// Package reconciler keeps the physical wrapper leases of the sandboxes this
// replica owns in Redis (written only under each sandbox's fencing token) and
// drives them with the provider: launch-or-reuse, stop attempts with the
// persisted backoff, and the leak sweep.
//
// API for the sandbox service (all methods are safe for concurrent use;
// operations on one runtime key are serialized in this process, and the
// fencing token serializes them across replicas):
//
//	r := reconciler.New(reconciler.Config{Redis: rdb, Provider: p})
//	r.Adopt(ctx, sandboxID, owner) // the *ownership.Owner: its resource and current token
//	    // when this replica takes (or re-takes) the sandbox's owner lease;
//	    // runs a leak sweep. Forget(sandboxID) when the owner lease is lost.
//	d, err := r.EnsureWrapper(ctx, sandboxID, runtimeKey, launch)
//	    // launch-or-reuse rule of DESIGN.md 3.2. launch(ctx, markers) is called
//	    // only after the owns_wrapper claim is persisted; it must start the
//	    // wrapper with exactly these markers (provider.Launch). d.Action is
//	    // Launched or Reused; ErrRefused (with d.RetryAfter) when a stop is
//	    // pending or discovery did not match, ErrInspectionFailed when the
//	    // provider could not look.
//	r.StartupVerified / DeliveryAccepted / RetainWarm(ctx, sandboxID, runtimeKey, instance, ...)
//	    // lease events of the owned wrapper; stale instances change nothing.
//	r.WrapperGone(ctx, sandboxID, runtimeKey, instance)
//	    // the wrapper's stream ended for good: discover, and release the lease
//	    // only on verified absence (else request a stop).
//	r.RequestStop(ctx, sandboxID, runtimeKey, reason)
//	    // stop every wrapper of the key (session-delete, allocation stop, ...).
//	ok, retryAfter, err := r.AbsenceVerified(ctx, sandboxID, runtimeKey)
//	    // for ReleaseRoute/deletion: true only when the lease is none and
//	    // discovery verified absence; otherwise it drives the stop one step
//	    // and says when to ask again.
//	l, err := r.Lease(ctx, sandboxID, runtimeKey)   // l.HoldsDelivery() holds Deliver
//	r.Run(ctx)   // loop: Tick every TickEvery, Sweep every SweepEvery
//	r.Tick(ctx)  // one pass over every adopted sandbox's leases
//
// Crash safety: a stop attempt persists its stopping claim (state, attempt
// id, 45 s watchdog) before any provider I/O, then calls provider.Stop, then
// persists the result for that attempt only; a result for an older attempt
// (or under an older token) is discarded. A crashed attempt is retried after
// its watchdog, never concurrently with another.
package reconciler
