// Package watermill runs idem's verdicts inside a Watermill router, so that
// every Watermill pub/sub gets durable, transactional deduplication: the
// marker of a message commits with the handler's own writes, and survives
// restarts, unlike Watermill's in-memory Deduplicator middleware.
//
// Handler maps each Watermill message to an idem.Message (the UUID is the
// ID; aggregate, sequence and type come from metadata) and decides it
// through an idem.DeliveryHandler: an idem.Consumer in atomic mode, an
// idem.LeaseConsumer in lease mode. The verdict becomes Watermill's:
// nil (acknowledge) once the outcome or its dead letter is committed, an
// error (Nack) for a retry, and never an acknowledgement while the store
// is unreachable. Publisher is the outbox relay's Publisher over any
// Watermill publisher.
//
// The package is its own Go module, so that idem's core does not depend
// on Watermill. docs/watermill.md has the wiring, the verdict table and
// how the Retry and PoisonQueue middlewares fit.
package watermill
