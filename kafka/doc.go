// Package kafka feeds an idem.DeliveryHandler (normally an idem.Consumer)
// from a Kafka consumer group with franz-go, and commits offsets only for
// records whose outcome is durable: applied, duplicate, stale or
// dead-lettered.
//
// A record whose verdict is "retry" holds its consumer: it is handled again
// after the verdict's delay, and nothing after it is processed or
// committed meanwhile, so the order within a partition is kept. Rebalances
// are blocked while a polled batch is being processed; when they happen,
// everything processed has been committed and nothing unprocessed has.
//
// See docs/kafka.md.
package kafka
