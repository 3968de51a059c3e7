package driver

import (
	"context"
	"time"
)

// LeaseDriver is the store contract of lease mode, for handlers whose effect
// lives outside the database (an HTTP call, an email, another store). It is
// separate from Driver so that drivers offering only atomic mode are
// unaffected.
//
// Lease rows share the marker table with atomic mode: (handler, message_id)
// is the primary key either way, and a row written by atomic mode reads as
// status LeaseDone with token 0.
//
// Every operation is its own short, auto-committed statement: no
// transaction stays open while the handler runs. LeaseClaim must decide and
// write in ONE atomic statement, so that two workers claiming at once can
// never both succeed. LeaseHeartbeat, LeaseComplete and LeaseFail are
// fenced: they change the row only while its token equals the caller's and
// its status is LeaseRunning.
//
// Time: a driver for a store reached from several hosts uses the store's own
// clock (now() on Postgres), so that workers agree on when a lease expires;
// an embedded store may use the local clock.
type LeaseDriver interface {
	// LeaseClaim takes the lease on (Handler, MessageID) for Owner until
	// TTL from now. In one atomic statement it either
	//
	//   - inserts a row with status LeaseRunning, token 1 and attempt 1, or
	//   - takes over an existing row with the same payload hash that is
	//     LeaseRunning with an expired lease, or LeaseFailed with a next
	//     attempt time that has come: status LeaseRunning, token and
	//     attempts +1, next attempt time cleared, or
	//   - changes nothing.
	//
	// In the last case Claimed is false and Existing holds the row as read
	// right after (nil if it vanished in between).
	LeaseClaim(ctx context.Context, p *LeaseClaimParams) (LeaseClaimResult, error)

	// LeaseHeartbeat sets the lease to expire TTL from now (normally an
	// extension), if Token is current.
	LeaseHeartbeat(ctx context.Context, p *LeaseHeartbeatParams) (LeaseWriteResult, error)

	// LeaseComplete marks the row LeaseDone, if Token is current. It clears
	// the lease, the next attempt time and the last error, and sets the
	// processed time to now.
	LeaseComplete(ctx context.Context, p *LeaseCompleteParams) (LeaseWriteResult, error)

	// LeaseFail marks the row LeaseFailed with LastError, if Token is
	// current. The next attempt time is RetryIn from now, or none (never
	// claimable again) when Permanent is set. It clears the lease.
	LeaseFail(ctx context.Context, p *LeaseFailParams) (LeaseWriteResult, error)

	// LeaseGet reads the row of (Handler, MessageID), or returns nil when
	// there is none.
	LeaseGet(ctx context.Context, p *LeaseGetParams) (*LeaseRow, error)
}

// LeaseStatus is the state of a row in lease mode.
type LeaseStatus string

const (
	// LeaseRunning: a worker holds the lease until LeaseUntil.
	LeaseRunning LeaseStatus = "running"
	// LeaseDone: the effect is recorded as done. Rows written by atomic
	// mode have this status.
	LeaseDone LeaseStatus = "done"
	// LeaseFailed: the last attempt failed; it may be claimed again from
	// NextAttemptAt, or never when NextAttemptAt is zero.
	LeaseFailed LeaseStatus = "failed"
)

// LeaseClaimParams are the parameters of LeaseDriver.LeaseClaim.
type LeaseClaimParams struct {
	// Handler is the validated handler name.
	Handler string
	// MessageID is the validated message ID.
	MessageID string
	// PayloadHash is the SHA-256 of the message payload. A row with a
	// different hash is never taken over.
	PayloadHash []byte
	// Owner identifies the claiming worker, for diagnostics only.
	Owner string
	// TTL is how long the lease lasts without a heartbeat. Positive.
	TTL time.Duration
}

// LeaseClaimResult reports what LeaseClaim did.
type LeaseClaimResult struct {
	// Claimed is true when the caller now holds the lease.
	Claimed bool
	// Token is the fencing token of the new lease (when Claimed).
	Token int64
	// Attempt is the row's attempt count including this claim (when
	// Claimed).
	Attempt int
	// LeaseUntil is when the new lease expires by the store's clock (when
	// Claimed).
	LeaseUntil time.Time
	// Existing is the row that prevented the claim (when not Claimed); nil
	// if the row vanished between the claim and the read.
	Existing *LeaseRow
}

// LeaseHeartbeatParams are the parameters of LeaseDriver.LeaseHeartbeat.
type LeaseHeartbeatParams struct {
	// Handler and MessageID name the lease's row.
	Handler   string
	MessageID string
	// Token is the caller's fencing token.
	Token int64
	// TTL is the new lease length, from now. Positive.
	TTL time.Duration
}

// LeaseCompleteParams are the parameters of LeaseDriver.LeaseComplete.
type LeaseCompleteParams struct {
	// Handler and MessageID name the lease's row.
	Handler   string
	MessageID string
	// Token is the caller's fencing token.
	Token int64
	// Advance, when set, moves the aggregate's last applied sequence (the
	// ordering guard's row for Handler) up to Advance.Seq, never down, in
	// the same transaction as the fenced update, and only if that update
	// succeeds. Only drivers implementing LeaseSequencer are given it.
	Advance *LeaseAdvance
}

// LeaseFailParams are the parameters of LeaseDriver.LeaseFail.
type LeaseFailParams struct {
	// Handler and MessageID name the lease's row.
	Handler   string
	MessageID string
	// Token is the caller's fencing token.
	Token int64
	// LastError describes the failure: valid UTF-8 without NUL bytes,
	// bounded in length by the caller.
	LastError string
	// RetryIn is the delay from now until the row may be claimed again.
	// Ignored when Permanent is set.
	RetryIn time.Duration
	// Permanent leaves the next attempt time empty: the row is never
	// claimed again automatically.
	Permanent bool
	// NotCalled says the claim ended without calling the handler (the
	// ordering guard released it to wait for a gap, or MaxAttempts was
	// used up by attempts that ended without a verdict): the claim's
	// attempt is given back, so waiting does not use up MaxAttempts and
	// the row counts the attempts that ran.
	NotCalled bool
}

// LeaseGetParams are the parameters of LeaseDriver.LeaseGet.
type LeaseGetParams struct {
	// Handler and MessageID name the lease's row.
	Handler   string
	MessageID string
}

// LeaseWriteResult reports a fenced write (heartbeat, complete, fail).
type LeaseWriteResult struct {
	// OK is true when the caller's token was current and the row was
	// updated.
	OK bool
	// Current is the row as found when OK is false (nil if there is no
	// row), so the caller can report who holds it now.
	Current *LeaseRow
}

// LeaseRow is a marker-table row as lease mode sees it.
type LeaseRow struct {
	// Status is running, done or failed.
	Status LeaseStatus
	// PayloadHash is the SHA-256 of the payload first claimed (or applied).
	PayloadHash []byte
	// Owner is the worker that last claimed the row; empty for rows
	// written by atomic mode.
	Owner string
	// Token is the fencing token of the last claim; 0 for rows written by
	// atomic mode.
	Token int64
	// Attempts counts the claims that called the handler or ended without
	// a verdict (a claim released without a call gives its attempt back).
	Attempts int
	// LeaseUntil is when the lease of a running row expires; zero
	// otherwise.
	LeaseUntil time.Time
	// NextAttemptAt is when a failed row may be claimed again; zero when
	// it never will be (or the row is not failed).
	NextAttemptAt time.Time
	// LastError is the error of the last failed attempt, if any.
	LastError string
	// Now is the store's clock when the row was read, to compare with
	// LeaseUntil and NextAttemptAt.
	Now time.Time
}

// LeaseAdvance is the sequence a completed lease advances its aggregate to.
type LeaseAdvance struct {
	// AggregateID's sequence advances to Seq.
	AggregateID string
	Seq         int64
}

// LeaseRearmer lets a lease-mode consumer replay the dead letter of a
// message that failed for good: before the replay, the row becomes
// claimable again.
type LeaseRearmer interface {
	// LeaseRearm sets the next attempt time of (handler, messageID) to now
	// and its attempt count to 0 if the row is LeaseFailed, so the replay
	// has MaxAttempts tries again, and does nothing otherwise (no row, or a
	// running or done one). The token keeps growing.
	LeaseRearm(ctx context.Context, handler, messageID string) error
}

// LeaseSequencer lets lease mode run the ordering guard: it reads an
// aggregate's last applied sequence before the handler runs, and
// LeaseComplete honours LeaseCompleteParams.Advance.
type LeaseSequencer interface {
	// SequenceLast returns the last applied sequence of (handler,
	// aggregate), 0 when none.
	SequenceLast(ctx context.Context, handler, aggregateID string) (int64, error)
	// GapSighting is SequenceGuard's: it records the first sighting of a
	// gap durably and returns it with the store's clock.
	GapSighting(ctx context.Context, p *GapSightingParams) (GapSightingResult, error)
}
