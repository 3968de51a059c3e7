// Package driver defines the contract between idem's core and its store
// drivers.
//
// The core owns the algorithm (validate → insert marker first → compare
// payload hashes → run the handler → commit); a driver owns only its SQL
// dialect, its schema and its transactions. Every driver must pass the
// conformance suite in package idemtest.
//
// The contract is generic over the driver's transaction type TTx, so a
// handler receives the driver's native transaction (for example *sql.Tx for
// SQLite) and ProcessTx accepts one the caller opened.
//
// Operations are named noun-first and take one params struct each, so that
// fields can be added without breaking drivers.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/atomic-mode.md#drivers
package driver

import "context"

// Driver is the transactional store contract every idem store driver
// implements.
type Driver[TTx any] interface {
	// Begin opens a read-write transaction.
	Begin(ctx context.Context) (TTx, error)
	// Commit commits tx. It must report an error if the transaction was
	// rolled back instead (for example because a statement in it failed).
	Commit(ctx context.Context, tx TTx) error
	// Rollback aborts tx. Rolling back a finished transaction is not an
	// error worth reporting to the user; drivers may return it anyway.
	// ctx may be done already: a consumer's stop cut the delivery short
	// (idem.ConsumerConfig.StopGrace), and the store may hang. The driver
	// must then not wait, nor pool the connection with tx still open:
	// drop the connection instead (the server rolls back when it goes).
	Rollback(ctx context.Context, tx TTx) error

	// MarkerInsert inserts one marker inside tx with ON CONFLICT DO NOTHING
	// semantics. When another transaction holds an uncommitted marker with
	// the same key, the call must wait for it and then report the committed
	// outcome (inserted if that transaction rolled back, not inserted with
	// the existing hash if it committed) rather than fail.
	MarkerInsert(ctx context.Context, tx TTx, p *MarkerInsertParams) (MarkerInsertResult, error)

	// MarkerInsertMany inserts several markers of one handler inside tx,
	// with the same semantics as MarkerInsert for each. The message IDs are
	// unique and sorted (so concurrent batches lock in one order). The
	// result has one entry per ID, in the order given.
	MarkerInsertMany(ctx context.Context, tx TTx, p *MarkerInsertManyParams) ([]MarkerInsertResult, error)

	// Migrate brings the schema up to date. It is safe to call
	// concurrently and repeatedly.
	Migrate(ctx context.Context) error
}

// BeginMarkerInserter is an optional fast path: open a transaction and insert
// the first marker in one round trip. The core uses it when a driver
// implements it. On error no transaction is left open.
type BeginMarkerInserter[TTx any] interface {
	BeginMarkerInsert(ctx context.Context, p *MarkerInsertParams) (TTx, MarkerInsertResult, error)
}

// BeginMarkerManyInserter is an optional fast path for batches: open a
// transaction and insert a batch's markers, with MarkerInsertMany's
// semantics, in as few round trips as the store allows. The core uses it
// for ProcessBatch when a driver implements it. On error no transaction is
// left open.
type BeginMarkerManyInserter[TTx any] interface {
	BeginMarkerInsertMany(ctx context.Context, p *MarkerInsertManyParams) (TTx, []MarkerInsertResult, error)
}

// CommitMarkerInserter is an optional fast path for a store that can check
// a marker and apply a transaction's writes in one call at commit (Redis,
// with a script): open a transaction whose marker is inserted by its
// Commit, together with the handler's writes. ok false means the store
// declines for this call (it is not configured for it); then no
// transaction is open and the core takes its other paths.
//
// The handler runs before the marker is checked. Commit then either
// applies the handler's writes and the marker, or, when the marker was
// there, applies nothing and returns a *MarkerExistsError with the stored
// hash, from which the core decides Duplicate or Conflict. The core uses
// it only for Process of a handler without an ordering guard, so a store
// must decline nothing else to keep every other path as it was. On error
// no transaction is left open.
type CommitMarkerInserter[TTx any] interface {
	BeginMarkerAtCommit(ctx context.Context, p *MarkerInsertParams) (tx TTx, ok bool, err error)
}

// MarkerExistsError is what Commit returns for a transaction opened by
// CommitMarkerInserter.BeginMarkerAtCommit whose marker had been committed
// before: nothing of the transaction was applied.
type MarkerExistsError struct {
	// ExistingHash is the stored marker's payload hash, as
	// MarkerInsertResult.ExistingHash.
	ExistingHash []byte
}

// Error implements error.
func (e *MarkerExistsError) Error() string {
	return "driver: the message's marker was already committed; nothing of the transaction was applied"
}

// DeferredBeginner is an optional fast path for transactions whose first
// statement has nothing to wait for (an in-row handler's own write, a
// version-only batch's guard): open a transaction whose BEGIN travels
// with its first statement rather than in a round trip of its own.
// Committing or rolling back a transaction that ran no statement must
// succeed without touching the store. The core uses it for those
// transactions when a driver implements it.
type DeferredBeginner[TTx any] interface {
	BeginDeferred(ctx context.Context) (TTx, error)
}

// MarkerDeleter removes markers inside a transaction. The core needs it for
// batches of a handler with an ordering guard: a batch inserts its markers
// first, and a message the guard then refuses (stale, or behind a gap)
// must leave no marker, exactly as when it is processed alone and its
// transaction rolls back.
type MarkerDeleter[TTx any] interface {
	// MarkerDelete deletes the markers of (Handler, each of MessageIDs)
	// that tx inserted. IDs without a marker are ignored.
	MarkerDelete(ctx context.Context, tx TTx, p *MarkerDeleteParams) error
}

// MarkerDeleteParams are the parameters of MarkerDeleter.MarkerDelete.
type MarkerDeleteParams struct {
	// Handler is the validated handler name.
	Handler string
	// MessageIDs are validated message IDs, unique.
	MessageIDs []string
}

// MarkerInsertParams are the parameters of Driver.MarkerInsert.
type MarkerInsertParams struct {
	// Handler is the validated handler name.
	Handler string
	// MessageID is the validated message ID.
	MessageID string
	// PayloadHash is the SHA-256 of the message payload.
	PayloadHash []byte
}

// MarkerInsertManyParams are the parameters of Driver.MarkerInsertMany.
type MarkerInsertManyParams struct {
	// Handler is the validated handler name.
	Handler string
	// MessageIDs are unique and sorted ascending (byte order).
	MessageIDs []string
	// PayloadHashes holds the SHA-256 of each message's payload, parallel
	// to MessageIDs.
	PayloadHashes [][]byte
}

// MarkerInsertResult reports what a marker insert found.
type MarkerInsertResult struct {
	// Inserted is true when this transaction now holds the marker.
	Inserted bool
	// ExistingHash is the payload hash of the committed marker that
	// prevented the insert. It is nil when Inserted is true. A store may
	// keep only a prefix of the SHA-256, of at least idem.MinStoredHash
	// (16) bytes; the core compares that prefix.
	ExistingHash []byte
}
