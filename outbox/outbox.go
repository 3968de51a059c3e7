package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// Outbox adds messages to the outbox table inside the caller's
// transactions. It is safe for concurrent use.
type Outbox[TTx any] struct {
	w        driver.OutboxWriter[TTx]
	next     driver.OutboxNextAdder[TTx] // nil: allocate, then add
	versions *idem.Versions[TTx]
}

// New returns an Outbox over drv, which must implement
// driver.OutboxWriter (the sqlite, postgres and mysql drivers do). Migrate
// the driver first: the outbox tables come with its migrations.
func New[TTx any](drv driver.Driver[TTx]) (*Outbox[TTx], error) {
	w, ok := drv.(driver.OutboxWriter[TTx])
	if !ok {
		return nil, fmt.Errorf("%w: %T does not implement driver.OutboxWriter", idem.ErrInvalidConfig, drv)
	}
	o := &Outbox[TTx]{w: w}
	o.next, _ = drv.(driver.OutboxNextAdder[TTx])
	if v, err := idem.NewVersions(drv); err == nil {
		o.versions = v
	}
	return o, nil
}

// MessageID returns the deterministic ID "<n>:<stream>-<aggregate>-<seq>",
// n being the stream's length in bytes: the same event gets the same ID
// however often it is published, and two events of different streams or
// aggregates never share one (without n, stream "orders" with aggregate
// "eu-7" and stream "orders-eu" with aggregate "7" would).
func MessageID(stream, aggregateID string, seq int64) string {
	return idPrefix(stream, aggregateID) + strconv.FormatInt(seq, 10)
}

// idPrefix is MessageID without the sequence.
func idPrefix(stream, aggregateID string) string {
	return strconv.Itoa(len(stream)) + ":" + stream + "-" + aggregateID + "-"
}

// Add inserts msgs into the outbox in tx; they are published after tx
// commits, and never if it rolls back. Each message needs an ID and a
// Stream, the topic or subject it is published to; rows of one aggregate
// are published in the order they were added. An invalid message
// (idem.Message.ValidatePublish) is a *idem.ValidationError and nothing is
// added. A message's Time is not kept: it is published with the time its
// row was added.
func (o *Outbox[TTx]) Add(ctx context.Context, tx TTx, msgs ...*idem.Message) error {
	rows := make([]driver.OutboxRow, len(msgs))
	for i, m := range msgs {
		r, err := newRow(m)
		if err != nil {
			return err
		}
		rows[i] = r
	}
	if err := o.w.OutboxAdd(ctx, tx, rows); err != nil {
		return fmt.Errorf("outbox: add: %w", err)
	}
	return nil
}

// newRow validates m and turns it into an outbox row.
func newRow(m *idem.Message) (driver.OutboxRow, error) {
	// Time is not kept (the row's time is published): it cannot make a
	// row unpublishable.
	if m != nil && !m.Time.IsZero() {
		c := *m
		c.Time = time.Time{}
		m = &c
	}
	if err := m.ValidatePublish(); err != nil {
		return driver.OutboxRow{}, fmt.Errorf("outbox: %w", err)
	}
	r := driver.OutboxRow{
		Destination: m.Stream, MessageID: m.ID, OrderingKey: m.AggregateID, AggregateID: m.AggregateID,
		Seq: m.Seq, Type: m.Type, Payload: m.Payload, PayloadHash: m.PayloadHash(),
	}
	if r.OrderingKey == "" {
		// Its own key. Sharing it with an aggregate named "msg:…" would
		// only make the two wait for each other.
		r.OrderingKey = "msg:" + m.ID
	}
	if len(m.Headers) > 0 {
		h, err := json.Marshal(m.Headers)
		if err != nil {
			return driver.OutboxRow{}, fmt.Errorf("outbox: message %q headers: %w", m.ID, err)
		}
		r.Headers = h
	}
	return r, nil
}

// AddNext allocates the next sequence of (stream, aggregateID) with the
// write-side allocator (idem.Versions) in tx, and adds a message with that
// sequence and the ID MessageID(stream, aggregateID, seq) — on Postgres in
// one statement. stream and aggregateID together may take at most 230
// bytes (231 with a stream under 100 bytes, 232 under 10), so that every
// sequence gives a valid ID of at most 255 bytes. The allocator
// locks the aggregate's row until tx ends, so concurrent writers of one
// aggregate add their rows in sequence order. It returns the message. An
// invalid message (idem.Message.ValidatePublish) is a *idem.ValidationError,
// and nothing is allocated or added.
//
// stream is the message's destination, its Stream: the Kafka topic or the
// JetStream subject, such as "orders.placed". It is not the name of a
// JetStream stream; that stream is yours to create, with subjects that
// cover this one.
func (o *Outbox[TTx]) AddNext(ctx context.Context, tx TTx, stream, aggregateID, typ string, payload []byte) (*idem.Message, error) {
	if o.versions == nil {
		return nil, fmt.Errorf("%w: the driver has no sequence allocator", idem.ErrInvalidConfig)
	}
	if n := len(MessageID(stream, aggregateID, math.MaxInt64)); n > idem.MaxIDLen {
		return nil, fmt.Errorf("outbox: stream and aggregate ID make message IDs of up to %d bytes; the maximum is %d: %w", n, idem.MaxIDLen, idem.ErrInvalidMessage)
	}
	m := &idem.Message{ID: MessageID(stream, aggregateID, 1), Stream: stream, Type: typ, AggregateID: aggregateID, Seq: 1, Payload: payload}
	// Validated before a sequence is allocated: a refused message must
	// leave nothing in tx, or a transaction that goes on commits a
	// sequence no event has, a gap for the consumers' ordering guard.
	row, err := newRow(m)
	if err != nil {
		return nil, err
	}
	if o.next != nil {
		row.MessageID = idPrefix(stream, aggregateID) // the driver appends the sequence
		seq, err := o.next.OutboxAddNext(ctx, tx, &row)
		if err != nil {
			return nil, fmt.Errorf("outbox: add: %w", err)
		}
		m.Seq, m.ID = seq, MessageID(stream, aggregateID, seq)
		return m, nil
	}
	seq, err := o.versions.Next(ctx, tx, stream, aggregateID)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	m.Seq, m.ID = seq, MessageID(stream, aggregateID, seq)
	if err := o.Add(ctx, tx, m); err != nil {
		return nil, err
	}
	return m, nil
}
