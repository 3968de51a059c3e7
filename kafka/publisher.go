package kafka

import (
	"context"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
)

// Publisher produces messages to Kafka and waits for the brokers'
// acknowledgements: the outbox relay's Publisher (see idem's outbox
// package). The topic is the message's Stream and the record key its
// aggregate, so one aggregate's records share a partition; the ID, sequence
// and type go in the headers DefaultMap reads, with the message's own
// Headers.
//
// Order within a partition rests on the client's idempotent producer
// (franz-go's default): records of one Publish call are written in order,
// and a failed record fails the ones after it rather than being overtaken.
type Publisher struct {
	cl *kgo.Client
}

// NewPublisher returns a Publisher on cl. Keep cl's idempotent producer
// (the default; do not set kgo.DisableIdempotentWrite).
func NewPublisher(cl *kgo.Client) (*Publisher, error) {
	if cl == nil {
		return nil, fmt.Errorf("%w: kafka: NewPublisher needs a client", idem.ErrInvalidConfig)
	}
	return &Publisher{cl: cl}, nil
}

// Publish produces msgs and returns once all are acknowledged.
func (p *Publisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	recs := make([]*kgo.Record, len(msgs))
	for i, m := range msgs {
		r := &kgo.Record{Topic: m.Stream, Key: []byte(m.AggregateID), Value: m.Payload}
		for k, v := range m.Headers {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
		}
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderID, Value: []byte(m.ID)})
		if m.Seq > 0 {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderSeq, Value: []byte(strconv.FormatInt(m.Seq, 10))})
		}
		if m.Type != "" {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderType, Value: []byte(m.Type)})
		}
		if !m.Time.IsZero() {
			r.Timestamp = m.Time
		}
		recs[i] = r
	}
	if err := p.cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return fmt.Errorf("kafka: produce %d records from %q: %w", len(msgs), msgs[0].ID, err)
	}
	return nil
}
