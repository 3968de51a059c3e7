package kafka_test

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/kafka"
)

// The client fails a record too large for a batch on its own and writes
// the ones after it: Publish refuses the whole call first, so a later
// message of the aggregate never overtakes the one that cannot go out.
func TestPublisherRefusesTooLargeRecord(t *testing.T) {
	b := newBroker(t).(*broker)
	for _, c := range []struct {
		opts []kgo.Opt
		size int // of the first message's payload
	}{
		{nil, 1_100_000},
		{[]kgo.Opt{kgo.ProducerBatchMaxBytes(4096)}, 4096},
		{[]kgo.Opt{kgo.MaxBufferedBytes(2048)}, 3000},
		// The topic's batch limit is above what a request may carry.
		{[]kgo.Opt{kgo.BrokerMaxWriteBytes(2 << 20), kgo.ProducerBatchMaxBytesFn(func(topic string) int32 {
			if topic == "" {
				return 1 << 20
			}
			return 4 << 20
		})}, 2<<20 - 40},
	} {
		pub := newPublisher(t, b, c.opts...)
		err := pub.Publish(context.Background(), []*idem.Message{
			{ID: "big", Stream: topic, AggregateID: "acct-1", Seq: 1, Payload: bytes.Repeat([]byte("x"), c.size)},
			{ID: "after", Stream: topic, AggregateID: "acct-1", Seq: 2, Payload: []byte("small")},
		})
		if !errors.Is(err, kafka.ErrRecordTooLarge) || !strings.Contains(err.Error(), `"big"`) {
			t.Fatalf("payload of %d bytes: Publish: %v, want ErrRecordTooLarge naming the message", c.size, err)
		}
	}
	// A record that fits goes out, and nothing of the refused calls did.
	pub := newPublisher(t, b, kgo.ProducerBatchMaxBytes(4096))
	if err := pub.Publish(context.Background(), []*idem.Message{
		{ID: "fits", Stream: topic, AggregateID: "acct-1", Payload: bytes.Repeat([]byte("x"), 3900)},
	}); err != nil {
		t.Fatal(err)
	}
	if ids := topicIDs(t, b, 1); !slices.Equal(ids, []string{"fits"}) {
		t.Fatalf("topic holds %v, want only fits", ids)
	}
}

// topicIDs reads the idem-id of every record in the topic until it has
// read n of them.
func topicIDs(t *testing.T, b *broker, n int) []string {
	t.Helper()
	var ids []string
	for _, r := range readAll(t, b.addrs, n) {
		for _, h := range r.Headers {
			if h.Key == kafka.HeaderID {
				ids = append(ids, string(h.Value))
			}
		}
	}
	return ids
}

// newPublisher returns a Publisher on a client of b with opts; both close
// at the test's end.
func newPublisher(t *testing.T, b *broker, opts ...kgo.Opt) *kafka.Publisher {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(b.addrs...)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	pub, err := kafka.NewPublisher(cl)
	if err != nil {
		t.Fatal(err)
	}
	return pub
}

// A message a consumer could only dead-letter as undecodable (no ID, a
// sequence without a key, no topic) fails the call, producing nothing.
func TestPublisherRefusesInvalidMessages(t *testing.T) {
	b := newBroker(t).(*broker)
	pub := newPublisher(t, b)
	for _, bad := range []*idem.Message{
		{Stream: topic, Payload: []byte("no ID")},
		{ID: "seq-only", Stream: topic, Seq: 1, Payload: []byte("x")},
		{ID: "no-topic", Payload: []byte("x")},
		{ID: "nul-type", Stream: topic, Type: "Cred\x00ited", Payload: []byte("x")},
		{ID: "own-seq", Stream: topic, Payload: []byte("x"), Headers: map[string]string{kafka.HeaderSeq: "n/a"}},
		{ID: "own-type", Stream: topic, Payload: []byte("x"), Headers: map[string]string{kafka.HeaderType: "Debited"}},
		// No topic Kafka can have: the client would wait for it until the
		// call's context ends.
		{ID: "slash-topic", Stream: "bad/topic", Payload: []byte("x")},
		{ID: "long-topic", Stream: strings.Repeat("t", 250), Payload: []byte("x")},
		{ID: "dot-topic", Stream: "..", Payload: []byte("x")},
	} {
		err := pub.Publish(context.Background(), []*idem.Message{{ID: "before", Stream: topic, Payload: []byte("x")}, bad})
		if !errors.Is(err, idem.ErrInvalidMessage) {
			t.Fatalf("Publish of %+v: %v, want ErrInvalidMessage", bad, err)
		}
	}
	// A key that is no aggregate ID (binary) goes out without a sequence:
	// DefaultMap takes it as a message without an aggregate.
	if err := pub.Publish(context.Background(), []*idem.Message{
		{ID: "fits", Stream: topic, Payload: []byte("x")},
		{ID: "binary-key", Stream: topic, AggregateID: "\x00\x00\x30\x39", Payload: []byte("x")},
	}); err != nil {
		t.Fatal(err)
	}
	if ids := topicIDs(t, b, 2); !slices.Equal(slices.Sorted(slices.Values(ids)), []string{"binary-key", "fits"}) {
		t.Fatalf("topic holds %v, want fits and binary-key", ids)
	}
}

// A client without idempotent writes that may have several produce
// requests in flight per broker can write a retried record after later
// ones of its key: NewPublisher refuses it. Without idempotent writes but
// one request at a time (franz-go's default then), and with idempotent
// writes, it is taken.
func TestNewPublisherRefusesReorderingClient(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opts []kgo.Opt
		ok   bool
	}{
		{"idempotent", nil, true},
		{"not idempotent, one in flight", []kgo.Opt{kgo.DisableIdempotentWrite()}, true},
		{"not idempotent, five in flight", []kgo.Opt{kgo.DisableIdempotentWrite(), kgo.MaxProduceRequestsInflightPerBroker(5)}, false},
	} {
		cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers("127.0.0.1:1")}, tc.opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		_, err = kafka.NewPublisher(cl)
		cl.Close()
		if tc.ok && err != nil {
			t.Errorf("%s: %v, want the client taken", tc.name, err)
		}
		if !tc.ok && !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", tc.name, err)
		}
	}
}
