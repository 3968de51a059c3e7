package watermill

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemhq/idem"
)

// Publisher is the outbox relay's Publisher (see idem's outbox package)
// over any Watermill message.Publisher: outbox.Relay publishes through
// Watermill. Each idem message becomes a Watermill message whose UUID is
// the idem ID and whose metadata carries the aggregate, sequence, type
// and time (the keys DefaultMap reads) with the message's own Headers,
// published to the topic named by its Stream.
//
// The relay counts a row published once Publish returns nil, so the
// Watermill publisher must return only once the pub/sub holds the message:
// watermill-sql and GoChannel do; watermill-amqp does with
// Config.Publish.ConfirmDelivery set. A republished row (the relay crashed
// between publishing and marking) has the same UUID, and a Handler takes
// it as a Duplicate.
type Publisher struct {
	pub message.Publisher
}

// NewPublisher returns a Publisher on pub.
func NewPublisher(pub message.Publisher) (*Publisher, error) {
	if pub == nil {
		return nil, fmt.Errorf("%w: watermill: NewPublisher needs a message.Publisher", idem.ErrInvalidConfig)
	}
	return &Publisher{pub: pub}, nil
}

// Publish sends msgs in order. It refuses the call, sending nothing, if any
// message is invalid (idem.Message.ValidatePublish; Stream is the topic).
// A run of consecutive messages to one topic goes in one call of the
// Watermill publisher, the next run only once it returned: no message
// overtakes an earlier one that failed.
func (p *Publisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	for _, m := range msgs {
		if err := m.ValidatePublish(); err != nil {
			return fmt.Errorf("watermill: publish: %w", err)
		}
	}
	for i := 0; i < len(msgs); {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("watermill: publish %q: %w", msgs[i].ID, err)
		}
		j := i + 1
		for j < len(msgs) && msgs[j].Stream == msgs[i].Stream {
			j++
		}
		run := make([]*message.Message, 0, j-i)
		for _, m := range msgs[i:j] {
			run = append(run, ToMessage(ctx, m))
		}
		if err := p.pub.Publish(msgs[i].Stream, run...); err != nil {
			return fmt.Errorf("watermill: publish %d messages from %q to %q: %w", j-i, msgs[i].ID, msgs[i].Stream, err)
		}
		i = j
	}
	return nil
}

// ToMessage returns m as a Watermill message, as Publisher sends it, with
// ctx as its context.
func ToMessage(ctx context.Context, m *idem.Message) *message.Message {
	wm := message.NewMessageWithContext(ctx, m.ID, m.Payload)
	for k, v := range m.Headers {
		wm.Metadata.Set(k, v)
	}
	if m.AggregateID != "" {
		wm.Metadata.Set(MetadataAggregate, m.AggregateID)
	}
	if m.Seq > 0 {
		wm.Metadata.Set(MetadataSeq, strconv.FormatInt(m.Seq, 10))
	}
	if m.Type != "" {
		wm.Metadata.Set(MetadataType, m.Type)
	}
	if !m.Time.IsZero() {
		wm.Metadata.Set(MetadataTime, m.Time.Format(time.RFC3339Nano))
	}
	return wm
}
