package jetstream

import (
	"context"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
)

// Publisher publishes messages to JetStream and waits for each
// acknowledgement before sending the next: the outbox relay's Publisher
// (see idem's outbox package). The subject is the message's Stream; the ID
// travels as Nats-Msg-Id, so the stream's duplicate window drops a
// republished copy inside it, and the consumer's markers catch the rest.
// The aggregate, sequence and type go in the headers DefaultMap reads,
// with the message's own Headers.
type Publisher struct {
	js jetstream.JetStream
}

// NewPublisher returns a Publisher on js.
func NewPublisher(js jetstream.JetStream) (*Publisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: jetstream: NewPublisher needs a JetStream", idem.ErrInvalidConfig)
	}
	return &Publisher{js: js}, nil
}

// Publish sends msgs in order, each once the previous one is stored.
func (p *Publisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	for _, m := range msgs {
		nm := &nats.Msg{Subject: m.Stream, Data: m.Payload, Header: nats.Header{}}
		for k, v := range m.Headers {
			nm.Header.Set(k, v)
		}
		nm.Header.Set(HeaderMsgID, m.ID)
		if m.AggregateID != "" {
			nm.Header.Set(HeaderAggregate, m.AggregateID)
		}
		if m.Seq > 0 {
			nm.Header.Set(HeaderSeq, strconv.FormatInt(m.Seq, 10))
		}
		if m.Type != "" {
			nm.Header.Set(HeaderType, m.Type)
		}
		if _, err := p.js.PublishMsg(ctx, nm, jetstream.WithMsgID(m.ID)); err != nil {
			return fmt.Errorf("jetstream: publish %q to %q: %w", m.ID, m.Stream, err)
		}
	}
	return nil
}
