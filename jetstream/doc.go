// Package jetstream feeds an idem.DeliveryHandler (normally an
// idem.Consumer) from a NATS JetStream durable pull consumer, and carries
// out its verdicts: Ack once the outcome is durable, NakWithDelay for a
// retry after the handler's backoff, Term after a dead letter is committed.
//
// JetStream's publish-side deduplication (the Nats-Msg-Id header within the
// stream's Duplicates window) only drops a second publish of the same ID
// within that window. It does nothing about redeliveries to consumers (an
// ack lost in a crash, an AckWait that ran out, a Nak): those are what idem
// turns into Duplicate outcomes.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/jetstream.md
package jetstream
