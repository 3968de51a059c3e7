// Package idem gives event consumers effectively-once processing on top of
// at-least-once delivery: for each handler, a message ID has at most one
// applied effect, however often the broker redelivers it, however many
// consumers receive it at once, and wherever the process crashes.
//
// # How it works
//
// Wrap the handler in a [Handler] and call [Processor.Process] for every
// delivery. In one database transaction the processor:
//
//  1. validates the envelope ([Message.Validate]) and the handler name;
//  2. inserts the marker (handler, message ID, payload hash) first, so
//     that a marker already there is found rather than written twice (with
//     ON CONFLICT DO NOTHING, or on Postgres a plain INSERT that bets the
//     message is new and, on a unique violation, starts again with ON
//     CONFLICT);
//  3. if the marker already existed, rolls back and reports [Duplicate]
//     (same payload hash) or [Conflict] (different payload);
//  4. otherwise runs the handler with the same transaction and commits.
//
// Acknowledge the delivery to the broker only after Process returns an
// outcome without error (or a Conflict you have dead-lettered).
//
// # The guarantee (atomic mode)
//
// The marker and the handler's writes commit or roll back together:
//
//   - Commit: effect and marker both exist. A redelivery is a Duplicate and
//     the handler is not called.
//   - Handler error or panic, crash before commit, lost connection: neither
//     exists. The next delivery applies the message.
//   - Two deliveries of the same ID at once: the second insert waits on the
//     primary key until the first transaction ends, then sees its marker
//     and reports Duplicate. Exactly one applies; neither gets an error.
//   - The same ID with a different payload is a contract violation of the
//     producer: Conflict, never applied. [OnConflictWarn] downgrades it to
//     a logged Duplicate.
//
// This is exactly-once only for effects written through the transaction the
// handler receives, in the same database as the marker. A handler that also
// calls an HTTP API or another store gets at-least-once for that call:
// a crash after the call and before commit repeats it.
//
// # Transactions you own
//
// [Processor.ProcessTx] runs inside a transaction the caller opened, for
// services that already manage their own unit of work; the marker commits
// with the caller's writes. [Processor.ProcessBatch] and
// [Processor.ProcessBatchTx] take a slice of messages in one transaction and
// hand the handler only the new ones, so it can apply them with one
// set-based write.
//
// # Lease mode (external effects)
//
// A handler whose effect lives outside the database (an HTTP call, an
// email, another store) is a [LeaseHandler], run by a [LeaseProcessor]. Each
// delivery claims (handler, message ID) in one atomic statement: a lease
// with an owner, an expiry and a fencing token that grows by one at every
// claim. The handler gets the token and a stable [IdempotencyKey] for the
// downstream API; its context is cancelled as soon as the lease is lost; a
// heartbeat extends the lease while it runs. Heartbeat, done and failed are
// written only while the token is current, otherwise they fail with a
// [*FencedError]. A delivery that finds a live lease, or a failed attempt
// waiting for its retry time, reports [InFlight]: do not acknowledge it,
// redeliver it later.
//
// This is at-least-once plus dedup, not exactly-once: a worker that dies
// after the effect and before done leaves a lease that expires after the
// TTL, and the next claim repeats the attempt with the same idempotency
// key. The effect happens once only if the downstream honours the key.
// docs/lease-mode.md states the guarantee and the knobs ([LeaseConfig],
// with IDEM_LEASE_* environment variables read by [LeaseConfig.FromEnv]).
//
// # Drivers
//
// Stores are drivers implementing [driver.Driver], and [driver.LeaseDriver]
// for lease mode: package sqlite (embedded, pure Go), package postgres
// (pgx) and package redisstore (atomic mode for Redis read models). Every
// driver passes the conformance suites in package idemtest that apply to
// it (Redis: atomic, ordering, dead letters), which you can run against
// your own database.
//
// # Outcomes and errors
//
// Outcomes are values, not errors: Duplicate is the library working. Errors
// are wrapped with %w and matchable with errors.Is and errors.As:
// [ErrInvalidMessage] and [ErrInvalidHandlerName] (a [*ValidationError]),
// [ErrConflict] (a [*ConflictError]), [*PanicError] for a handler that
// panicked, and the handler's own error. [IsPermanent] tells which errors
// are pointless to retry; wrap your own with [Permanent]. Lease mode adds
// [ErrFenced] (a [*FencedError]), [ErrLeaseExpired] (the cause of a lost
// lease's cancelled context) and [ErrFailedPermanently].
//
// # Observability
//
// Pass hooks in [Config.Hooks]: any value implementing [HookOutcome] is told
// every outcome and its duration, and one implementing [HookCall] runs
// around every call with the context the call then uses, so metrics
// (package metrics) and tracing (package tracing) plug in without the core
// importing them.
//
// # Guides
//
// Read them in this order; docs/README.md has a glossary and every table
// idem creates:
//
//   - atomic mode, the contract: https://github.com/idemhq/idem/blob/main/docs/atomic-mode.md
//   - the brokers: https://github.com/idemhq/idem/blob/main/docs/jetstream.md and https://github.com/idemhq/idem/blob/main/docs/kafka.md
//   - failures, dead letters, metrics: https://github.com/idemhq/idem/blob/main/docs/operations.md
//   - lease mode: https://github.com/idemhq/idem/blob/main/docs/lease-mode.md
//   - the outbox: https://github.com/idemhq/idem/blob/main/docs/outbox.md
//   - ordering: https://github.com/idemhq/idem/blob/main/docs/ordering.md
//   - retention: https://github.com/idemhq/idem/blob/main/docs/retention.md
//   - the reading order and glossary: https://github.com/idemhq/idem/blob/main/docs/README.md
//   - programs to copy, each checking itself: https://github.com/idemhq/idem/blob/main/examples
package idem
