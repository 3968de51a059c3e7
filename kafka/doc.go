// Package kafka feeds an idem.DeliveryHandler (normally an idem.Consumer)
// from a Kafka consumer group with franz-go, and commits offsets only for
// records whose outcome is durable: applied, duplicate, stale or
// dead-lettered.
//
// A record whose verdict is "retry" holds its partition: the partition is
// rewound to the record and paused for the verdict's delay, so nothing
// after it is committed meanwhile, and, one record at a time, nothing
// after it is processed either, so the order within the partition is kept,
// while the member's other partitions flow. (In a batch, the records after
// it with other keys are decided with the batch: per-key order holds.)
// Rebalances are blocked while a poll's records are being processed (never
// during a retry's delay), and a poll told that a rebalance waits stops at
// its next record or batch; when they happen, nothing unprocessed has been
// committed.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/kafka.md
package kafka
