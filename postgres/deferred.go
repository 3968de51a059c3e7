package postgres

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemhq/idem/driver"
)

var _ driver.DeferredBeginner[Tx] = (*Driver)(nil)

// BeginDeferred implements driver.DeferredBeginner: it takes a pooled
// connection, and BEGIN goes in the same round trip as the transaction's
// first statement. A transaction that runs no statement ends without a
// round trip.
func (d *Driver) BeginDeferred(ctx context.Context) (Tx, error) {
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &connTx{c: c, deferred: true}, nil
}

// withBegin returns b with BEGIN queued first, when the transaction has
// not begun yet, and reports whether it did so.
func (t *connTx) withBegin(b *pgx.Batch) (*pgx.Batch, bool) {
	if !t.deferred {
		return b, false
	}
	t.deferred = false
	qs := make([]*pgx.QueuedQuery, 0, len(b.QueuedQueries)+1)
	qs = append(qs, &pgx.QueuedQuery{SQL: beginSQL})
	return &pgx.Batch{QueuedQueries: append(qs, b.QueuedQueries...)}, true
}

// begin sends a deferred BEGIN on its own.
func (t *connTx) begin(ctx context.Context) error {
	if !t.deferred {
		return nil
	}
	t.deferred = false
	_, err := t.c.Exec(ctx, beginSQL)
	return err
}

// one returns a batch of sql with args behind the deferred BEGIN, sent,
// with the BEGIN's result read.
func (t *connTx) one(ctx context.Context, sql string, args []any) (pgx.BatchResults, error) {
	b := &pgx.Batch{}
	b.Queue(sql, args...)
	b, _ = t.withBegin(b)
	br := t.c.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return nil, err
	}
	return br, nil
}

// skipBegin is the results of a batch sent with a deferred BEGIN in front:
// the BEGIN's result is read before the caller's first one.
type skipBegin struct {
	pgx.BatchResults
	skipped bool
	err     error
}

func (s *skipBegin) skip() error {
	if !s.skipped {
		s.skipped = true
		_, s.err = s.BatchResults.Exec()
	}
	return s.err
}

func (s *skipBegin) Exec() (pgconn.CommandTag, error) {
	if err := s.skip(); err != nil {
		return pgconn.CommandTag{}, err
	}
	return s.BatchResults.Exec()
}

func (s *skipBegin) Query() (pgx.Rows, error) {
	if err := s.skip(); err != nil {
		return nil, err
	}
	return s.BatchResults.Query()
}

func (s *skipBegin) QueryRow() pgx.Row {
	if err := s.skip(); err != nil {
		return errRow{err}
	}
	return s.BatchResults.QueryRow()
}

// errRow is a row whose Scan fails with err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// batchRow is the row of a one-statement batch: scanning it closes the
// batch.
type batchRow struct {
	row pgx.Row
	br  pgx.BatchResults
}

func (r *batchRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if cerr := r.br.Close(); err == nil {
		err = cerr
	}
	return err
}

// batchRows is the rows of a one-statement batch: closing them closes the
// batch.
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
	err    error
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *batchRows) Close() {
	r.Rows.Close()
	if !r.closed {
		r.closed = true
		r.err = r.br.Close()
	}
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.err
}
