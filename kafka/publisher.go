package kafka

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/twmb/franz-go/pkg/kerr"
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
// and a batch the brokers refuse fails the partition's records buffered
// after it. The client fails a record too large for a batch on its own,
// though, and would write the ones after it: Publish refuses such a call
// before producing anything (ErrRecordTooLarge), so that no record
// overtakes an earlier one of its aggregate.
type Publisher struct {
	cl *kgo.Client
	// The client's size limits, read once (OptValue looks options up by
	// reflection): its batch limit per topic, write limit less a produce
	// request's overhead and client ID, and buffer limit (0: none).
	batchMax func(topic string) int32
	writeMax int64
	bufMax   int64
}

// NewPublisher returns a Publisher on cl. Keep cl's idempotent producer
// (the default; do not set kgo.DisableIdempotentWrite). Without it, a
// client allowed more than one produce request in flight per broker
// (kgo.MaxProduceRequestsInflightPerBroker) may write a retried record
// after the ones sent behind it, an aggregate's events out of their
// order: NewPublisher refuses that client with idem.ErrInvalidConfig.
func NewPublisher(cl *kgo.Client) (*Publisher, error) {
	if cl == nil {
		return nil, fmt.Errorf("%w: kafka: NewPublisher needs a client", idem.ErrInvalidConfig)
	}
	if off, _ := cl.OptValue(kgo.DisableIdempotentWrite).(bool); off {
		if n, _ := cl.OptValue(kgo.MaxProduceRequestsInflightPerBroker).(int); n > 1 {
			return nil, fmt.Errorf("%w: kafka: the client has idempotent writes off and %d produce requests in flight per broker: a retried record could land after later ones of its key; keep idempotent writes or allow one request in flight", idem.ErrInvalidConfig, n)
		}
	}
	p := &Publisher{cl: cl, writeMax: math.MaxInt64}
	p.batchMax, _ = cl.OptValue(kgo.ProducerBatchMaxBytesFn).(func(string) int32)
	if w, ok := cl.OptValue(kgo.BrokerMaxWriteBytes).(int32); ok && w > 0 {
		clientID, _ := cl.OptValue(kgo.ClientID).(string)
		p.writeMax = int64(w) - requestOverhead - int64(len(clientID))
	}
	p.bufMax, _ = cl.OptValue(kgo.MaxBufferedBytes).(int64)
	return p, nil
}

// ErrRecordTooLarge is returned by Publisher.Publish, with nothing of the
// call produced, when a message's record would exceed the client's batch
// limit (kgo.ProducerBatchMaxBytes, about 1 MB by default) or buffer limit
// (kgo.MaxBufferedBytes). Raise the limit on the client (and the topic's
// max.message.bytes on the brokers), or keep such payloads out of Kafka.
var ErrRecordTooLarge = errors.New("kafka: record too large for the producer")

// recordOverhead bounds what a record batch of one record adds to the
// record's key, value and header bytes: the batch header (61 bytes) and the
// record's varint lengths, deltas and attributes at their widest.
const recordOverhead = 61 + 5 + 1 + 10 + 5 + 5 + 5 + 5

// requestOverhead bounds what a produce request of one batch adds to the
// batch, its client ID and topic name: franz-go counts about 54 bytes.
const requestOverhead = 128

// checkSize returns an error wrapping ErrRecordTooLarge if r, the record
// of message id, may not fit a batch or the buffer of the client.
func (p *Publisher) checkSize(id string, r *kgo.Record) error {
	user := int64(len(r.Key) + len(r.Value))
	wire := int64(recordOverhead) + user
	for _, h := range r.Headers {
		user += int64(len(h.Key) + len(h.Value))
		wire += int64(len(h.Key)+len(h.Value)) + 10
	}
	// The client's limit for a topic's batches is the lower of its batch
	// limit and what fits a produce request of one batch under its write
	// limit (the request's header, client ID and topic name besides).
	limit := p.writeMax - int64(max(len(r.Topic), 16))
	if p.batchMax != nil {
		limit = min(limit, int64(p.batchMax(r.Topic)))
	}
	if wire > limit {
		return fmt.Errorf("%w: message %q: a record of up to %d bytes, over the batch limit of %d for topic %q", ErrRecordTooLarge, id, wire, limit, r.Topic)
	}
	if p.bufMax > 0 && user > p.bufMax {
		return fmt.Errorf("%w: message %q: %d bytes, over the buffer limit of %d", ErrRecordTooLarge, id, user, p.bufMax)
	}
	return nil
}

// Unavailable reports whether err, returned by Publish, may come from the
// cluster being out of reach rather than from a message (an invalid one,
// ErrRecordTooLarge) or a broker's answer about it (a Kafka error code:
// an unknown topic, a record the broker finds too large, a denied
// write): the outbox relay then probes the cluster (Probe) and, if the
// probe fails too, pauses its publishes without counting an attempt on
// the rows (outbox.BrokerProber).
func (p *Publisher) Unavailable(err error) bool {
	var ke *kerr.Error
	return err != nil && !errors.Is(err, idem.ErrInvalidMessage) && !errors.Is(err, ErrRecordTooLarge) && !errors.As(err, &ke)
}

// Probe returns nil when a broker of the cluster answers (the client's
// Ping); see Unavailable.
func (p *Publisher) Probe(ctx context.Context) error {
	if err := p.cl.Ping(ctx); err != nil {
		return fmt.Errorf("kafka: probe: %w", err)
	}
	return nil
}

// Publish produces msgs and returns once all are acknowledged. An invalid
// message (Message.ValidatePublish: Stream is the topic; a key that is no
// aggregate ID is fine without a sequence; a Stream that is no name Kafka
// takes for a topic, see badTopic), or one whose record may not fit
// the client's limits (ErrRecordTooLarge), fails the call before anything
// is produced. A message without an AggregateID gets no record key.
func (p *Publisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	for _, m := range msgs {
		if m == nil {
			return fmt.Errorf("kafka: publish: %w: nil message", idem.ErrInvalidMessage)
		}
		// What DefaultMap refuses: a key that is no aggregate ID (binary,
		// long) is fine without a sequence, it only leaves the message
		// without an aggregate.
		v := *m
		if v.Seq == 0 {
			v.AggregateID = ""
		}
		if err := v.ValidatePublish(); err != nil {
			return fmt.Errorf("kafka: publish: %w", err)
		}
		if reason := badTopic(m.Stream); reason != "" {
			return fmt.Errorf("kafka: publish %q: %w: Stream %q is no Kafka topic: %s", m.ID, idem.ErrInvalidMessage, m.Stream, reason)
		}
	}
	recs := make([]*kgo.Record, len(msgs))
	for i, m := range msgs {
		r := &kgo.Record{Topic: m.Stream, Value: m.Payload}
		if m.AggregateID != "" {
			// A message without an aggregate has no key (null, not
			// empty): the partitioner spreads such records, where it
			// would hash an empty key to one partition.
			r.Key = []byte(m.AggregateID)
		}
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
		if err := p.checkSize(m.ID, r); err != nil {
			return err
		}
		recs[i] = r
	}
	if err := p.cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return fmt.Errorf("kafka: produce %d records from %q: %w", len(msgs), msgs[0].ID, err)
	}
	return nil
}

// maxTopicLen is the longest topic name Kafka takes.
const maxTopicLen = 249

// badTopic says why Kafka can never have topic, or "": a name of 1 to 249
// ASCII letters, digits, '.', '_' and '-', other than "." and "..". The
// client would wait for such a topic, once a record is buffered, until
// the call's context ends, where a refusal here names the reason at once.
func badTopic(topic string) string {
	switch {
	case len(topic) > maxTopicLen:
		return fmt.Sprintf("it is %d bytes; the maximum is %d", len(topic), maxTopicLen)
	case topic == "." || topic == "..":
		return "it is . or .."
	}
	for i := 0; i < len(topic); i++ {
		c := topic[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Sprintf("it has %q at offset %d; a topic is ASCII letters, digits, '.', '_' and '-'", topic[i:i+1], i)
		}
	}
	return ""
}
