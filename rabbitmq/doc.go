// Package rabbitmq feeds an idem.DeliveryHandler (normally an
// idem.Consumer or idem.LeaseConsumer) from a RabbitMQ queue with manual
// acknowledgements, and carries out its verdicts: Ack once the outcome or
// its dead letter is committed; for a retry, a copy of the message goes to
// a retry queue whose TTL hands it back to the work queue after the
// verdict's delay, and the delivery is acked only once the broker has
// confirmed that copy. A plain requeue would come back at once, at the
// head of the queue: a hot loop.
//
// Publisher is the outbox relay's publisher: publisher confirms, the
// mandatory flag (an unroutable message is an error, not a silent
// success), and the message ID in the message-id property.
//
// RabbitMQ redelivers whatever a consumer left unacknowledged when its
// channel closes (a crash, a lost connection). Those redeliveries are what
// idem turns into Duplicate outcomes.
//
// See docs/rabbitmq.md for the topology, the configuration and what is
// guaranteed.
package rabbitmq
