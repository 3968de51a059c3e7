// Package outbox is idem's producing side: a transactional outbox and the
// relay that publishes it.
//
// Add writes messages into the outbox table inside the caller's business
// transaction, so an event exists if and only if the transaction that raised
// it committed. A Relay publishes pending rows through a Publisher (the
// kafka, jetstream and rabbitmq packages provide one each), waits for the broker's
// acknowledgement and only then marks the rows published. A relay that
// crashes between publishing and marking publishes those rows again on
// restart: delivery is at-least-once, and the consumer's idem.Processor
// turns the repeat into a Duplicate. Deterministic message IDs (MessageID)
// make a republished row the same message.
//
// Several relays may run against one outbox. They claim ordering keys (the
// aggregate ID, or the message ID for a message without one) in the store,
// with a lease: while a claim lives, no other relay publishes that key's
// rows, so one aggregate's rows go out in order, one relay at a time, and
// different aggregates spread across relays.
//
// An outage is not a failure of the rows. When the store is down, a relay
// whose driver can probe it pauses until it answers; when the broker is
// down, a relay whose Publisher implements BrokerProber does the same,
// counting no attempt on the rows and holding no key. Either way one log
// line marks the outage and one its end.
//
// Admin lists the rows not yet published, with their state and last
// error, and lets an operator retry one now, park one the broker will
// never take (it then holds its aggregate's later rows, so order is never
// broken), or discard one. A relay reports its cycles to RelayConfig.Hooks
// (HookCycle), which the metrics package counts.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/outbox.md
package outbox
