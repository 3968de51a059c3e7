package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemhq/idem/driver"
)

// Versions is the write side of ordering, for services that emit events: a
// per-aggregate version counter kept in the same database and advanced
// inside the caller's business transaction.
//
// Next allocates the next sequence for an event (no number is given to two
// committed transactions and, because the counter row stays locked until the
// transaction ends, a rolled-back transaction gives its number back: the
// committed sequence has no gaps on SQLite and Postgres). Advance is
// optimistic concurrency: it moves the version from the one the caller read
// to the next in one conditional statement, or fails with an
// *ExpectedVersionError.
type Versions[TTx any] struct {
	store driver.VersionStore[TTx]
}

// NewVersions returns the write-side API over drv, which must implement
// driver.VersionStore (both bundled drivers do).
func NewVersions[TTx any](drv driver.Driver[TTx]) (*Versions[TTx], error) {
	vs, ok := drv.(driver.VersionStore[TTx])
	if !ok {
		return nil, fmt.Errorf("%w: %T does not implement driver.VersionStore", ErrInvalidConfig, drv)
	}
	return &Versions[TTx]{store: vs}, nil
}

func checkAggregate(stream, aggregateID string) error {
	if stream != "" { // empty is the default stream
		if reason := checkText(stream, MaxIDLen); reason != "" {
			return &ValidationError{Field: "stream", Reason: reason, Value: stream, err: ErrInvalidMessage}
		}
	}
	if reason := checkText(aggregateID, MaxIDLen); reason != "" {
		return &ValidationError{Field: "AggregateID", Reason: reason, Value: aggregateID, err: ErrInvalidMessage}
	}
	return nil
}

// Next allocates the next version of (stream, aggregateID) inside tx and
// returns it: 1 for a new aggregate. Use it as the Seq of the event the
// transaction emits (see the outbox's deterministic message IDs).
func (v *Versions[TTx]) Next(ctx context.Context, tx TTx, stream, aggregateID string) (int64, error) {
	if err := checkAggregate(stream, aggregateID); err != nil {
		return 0, err
	}
	n, err := v.store.VersionNext(ctx, tx, &driver.VersionParams{Stream: stream, AggregateID: aggregateID})
	if err != nil {
		return 0, fmt.Errorf("idem: allocate version of %q/%q: %w", stream, aggregateID, err)
	}
	return n, nil
}

// Current reads the version of (stream, aggregateID): 0 if it has none.
func (v *Versions[TTx]) Current(ctx context.Context, tx TTx, stream, aggregateID string) (int64, error) {
	if err := checkAggregate(stream, aggregateID); err != nil {
		return 0, err
	}
	n, err := v.store.VersionCurrent(ctx, tx, &driver.VersionParams{Stream: stream, AggregateID: aggregateID})
	if err != nil {
		return 0, fmt.Errorf("idem: read version of %q/%q: %w", stream, aggregateID, err)
	}
	return n, nil
}

// Advance moves (stream, aggregateID) from version expected to expected+1
// inside tx and returns the new version. The comparison and the update are
// one statement (never read-compare-write), so two writers that read the
// same version cannot both succeed. When the version is not expected it
// returns an *ExpectedVersionError (matching ErrExpectedVersion); roll the
// transaction back, and retry from a fresh read with RetryVersionConflicts.
func (v *Versions[TTx]) Advance(ctx context.Context, tx TTx, stream, aggregateID string, expected int64) (int64, error) {
	if err := checkAggregate(stream, aggregateID); err != nil {
		return 0, err
	}
	if expected < 0 {
		return 0, &ValidationError{Field: "expected version", Reason: fmt.Sprintf("is %d; must be ≥ 0", expected), err: ErrInvalidMessage}
	}
	ok, cur, err := v.store.VersionAdvance(ctx, tx, &driver.VersionParams{Stream: stream, AggregateID: aggregateID, Expected: expected})
	if err != nil {
		return 0, fmt.Errorf("idem: advance version of %q/%q: %w", stream, aggregateID, err)
	}
	if !ok {
		return 0, &ExpectedVersionError{Stream: stream, AggregateID: aggregateID, Expected: expected, Actual: cur}
	}
	return cur, nil
}

// ErrExpectedVersion matches every *ExpectedVersionError.
var ErrExpectedVersion = errors.New("idem: unexpected aggregate version")

// ExpectedVersionError reports an optimistic-concurrency conflict: another
// writer advanced the aggregate since the caller read it. In an HTTP API it
// maps to 409 Conflict (with If-Match/ETag, to 412 Precondition Failed).
type ExpectedVersionError struct {
	// Stream and AggregateID name the aggregate.
	Stream, AggregateID string
	// Expected is the version the caller read; Actual the one stored.
	Expected, Actual int64
}

// Error implements error.
func (e *ExpectedVersionError) Error() string {
	return fmt.Sprintf("idem: %q/%q is at version %d, expected %d", e.Stream, e.AggregateID, e.Actual, e.Expected)
}

// Is makes errors.Is(err, ErrExpectedVersion) true.
func (e *ExpectedVersionError) Is(target error) bool { return target == ErrExpectedVersion }

// RetryVersionConflicts runs fn, and runs it again after a jittered
// exponential delay each time it fails with an *ExpectedVersionError, up to
// b.Retries times (nil b: 3 retries from 50ms up to 1s). fn must do the
// whole read-decide-write in a fresh transaction each time. Other errors,
// and the last conflict, are returned as they are; a cancelled ctx stops
// the waiting.
func RetryVersionConflicts(ctx context.Context, b *Backoff, fn func(ctx context.Context) error) error {
	if b == nil {
		b = &Backoff{}
	}
	retries := b.Retries
	if retries == 0 {
		retries = 3
	}
	for n := 0; ; n++ {
		err := fn(ctx)
		if err == nil || !errors.Is(err, ErrExpectedVersion) || n >= retries {
			return err
		}
		t := time.NewTimer(b.Delay(n))
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("idem: retry stopped: %w (last conflict: %w)", ctx.Err(), err)
		case <-t.C:
		}
	}
}
