package rabbitmq_test

import (
	"errors"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/rabbitmq"
)

// FuzzDefaultMap: any properties and headers map to a valid message or a
// clear error matching idem.ErrInvalidMessage, never a panic; a mapped
// message carries the message-id property's ID, else the idem-id header's,
// and the sequence the header holds, as text or as an integer.
func FuzzDefaultMap(f *testing.F) {
	f.Add("evt-1", "", "acct-1", "3", false, "Credited", "credits", []byte("10"))
	f.Add("", "evt-2", "", "", false, "", "", []byte{})
	f.Add("", "", "a", "x", false, "", "q", []byte("no id"))
	f.Add("e\x00", "", "a", "0", true, "", "q", []byte(nil))
	f.Add("\xff", "id", "agg", "-1", false, "t", "q", []byte("v"))
	f.Add("id", "", "", "9223372036854775807", true, "", "q", []byte("v"))
	f.Add("id", "", "agg", "12", true, "", "q", []byte("v"))
	f.Fuzz(func(t *testing.T, messageID, idemID, aggregate, seq string, seqAsInt bool, typ, routingKey string, body []byte) {
		h := amqp.Table{}
		if idemID != "" {
			h[rabbitmq.HeaderID] = idemID
		}
		if aggregate != "" {
			h[rabbitmq.HeaderAggregate] = []byte(aggregate)
		}
		var seqInt int64
		if seq != "" {
			if n, err := strconv.ParseInt(seq, 10, 64); seqAsInt && err == nil {
				h[rabbitmq.HeaderSeq] = n
			} else {
				h[rabbitmq.HeaderSeq] = seq
			}
			seqInt, _ = strconv.ParseInt(seq, 10, 64)
		}
		h["traceparent"] = "00-abc-def-01"
		m, err := rabbitmq.MapMessage(messageID, typ, routingKey, time.Time{}, h, body)
		if err != nil {
			if m != nil {
				t.Fatalf("error %v with a message", err)
			}
			if err.Error() == "" {
				t.Fatal("empty error text")
			}
			if !errors.Is(err, idem.ErrInvalidMessage) {
				t.Fatalf("error %v does not match ErrInvalidMessage", err)
			}
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("mapped message invalid: %v", err)
		}
		want := messageID
		if want == "" {
			want = idemID
		}
		if m.ID != want {
			t.Fatalf("ID %q, want %q", m.ID, want)
		}
		if seq != "" && m.Seq != seqInt {
			t.Fatalf("Seq %d from header %q", m.Seq, seq)
		}
		if m.AggregateID != aggregate || m.Type != typ || m.Stream != routingKey || string(m.Payload) != string(body) {
			t.Fatalf("mapped %+v from aggregate %q, type %q, routing key %q", m, aggregate, typ, routingKey)
		}
		if m.Headers["traceparent"] != "00-abc-def-01" {
			t.Fatalf("headers %v lost traceparent", m.Headers)
		}
	})
}

// DefaultMap reads the idem headers and keeps the others that are text,
// numbers or booleans; nested tables, RabbitMQ's x- headers and idem's own
// do not reach Headers. A retry copy's first routing key is its Stream.
func TestDefaultMapHeaders(t *testing.T) {
	at := time.Date(2026, 11, 26, 12, 0, 0, 123456789, time.UTC)
	d := &amqp.Delivery{MessageId: "evt-1", RoutingKey: "orders.idem-retry", Body: []byte("x"), Headers: amqp.Table{
		rabbitmq.HeaderAggregate: "acct-1", rabbitmq.HeaderSeq: int32(7), rabbitmq.HeaderType: "Credited",
		rabbitmq.HeaderTime: at.Format(time.RFC3339Nano), rabbitmq.HeaderAttempt: int64(3),
		rabbitmq.HeaderRoutingKey: "credits.eu", "tenant": "t1", "n": int16(5), "flag": true,
		"x-death": []any{amqp.Table{"count": int64(1)}}, "nested": amqp.Table{"a": "b"},
	}}
	m, err := rabbitmq.DefaultMap(d)
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "evt-1" || m.AggregateID != "acct-1" || m.Seq != 7 || m.Type != "Credited" || !m.Time.Equal(at) || m.Stream != "credits.eu" {
		t.Fatalf("mapped %+v", m)
	}
	want := map[string]string{"tenant": "t1", "n": "5", "flag": "true"}
	if len(m.Headers) != len(want) {
		t.Fatalf("headers %v, want %v", m.Headers, want)
	}
	for k, v := range want {
		if m.Headers[k] != v {
			t.Fatalf("headers %v, want %v", m.Headers, want)
		}
	}
	// The type property wins over the header; the timestamp property
	// stands in for a missing idem-time.
	d = &amqp.Delivery{MessageId: "evt-2", Type: "Debited", Timestamp: at.Truncate(time.Second), Headers: amqp.Table{rabbitmq.HeaderType: "Credited"}}
	if m, err = rabbitmq.DefaultMap(d); err != nil || m.Type != "Debited" || !m.Time.Equal(at.Truncate(time.Second)) {
		t.Fatalf("mapped %+v, %v", m, err)
	}
	// Not text where text is due, or a time that does not parse: a decode
	// failure naming the header.
	for name, h := range map[string]amqp.Table{
		rabbitmq.HeaderID:        {rabbitmq.HeaderID: int64(5)},
		rabbitmq.HeaderAggregate: {rabbitmq.HeaderID: "e", rabbitmq.HeaderAggregate: 1.5},
		rabbitmq.HeaderTime:      {rabbitmq.HeaderID: "e", rabbitmq.HeaderTime: "yesterday"},
		rabbitmq.HeaderSeq:       {rabbitmq.HeaderID: "e", rabbitmq.HeaderAggregate: "a", rabbitmq.HeaderSeq: 2.0},
	} {
		if _, err := rabbitmq.DefaultMap(&amqp.Delivery{Headers: h}); !errors.Is(err, idem.ErrInvalidMessage) {
			t.Errorf("%s: %v, want ErrInvalidMessage", name, err)
		}
	}
}

// Retry delays round up to a tier, a power of two of milliseconds from 16
// ms, capped.
func TestRetryTiers(t *testing.T) {
	for d, want := range map[time.Duration]time.Duration{
		0: 16 * time.Millisecond, time.Millisecond: 16 * time.Millisecond, 16 * time.Millisecond: 16 * time.Millisecond,
		16*time.Millisecond + time.Microsecond: 32 * time.Millisecond, 50 * time.Millisecond: 64 * time.Millisecond,
		time.Second: 1024 * time.Millisecond, 1000 * time.Hour: (1 << 24) * time.Millisecond,
	} {
		if got := rabbitmq.TierOf(d); got != want {
			t.Errorf("tier of %s = %s, want %s", d, got, want)
		}
	}
	tiers := rabbitmq.RetryTiers()
	if tiers[0] != 16*time.Millisecond || tiers[len(tiers)-1] != (1<<24)*time.Millisecond {
		t.Fatalf("tiers %v", tiers)
	}
}

// A delivery's attempt is its idem-attempt header (1 without one) plus the
// returns the queue counted: x-delivery-count on quorum queues, or one for
// a classic queue's redelivered flag. A delivery not redelivered was never
// returned, and a classic queue's x-delivery-count is the producer's.
func TestAttemptCountsCopiesAndReturns(t *testing.T) {
	for _, c := range []struct {
		h           amqp.Table
		redelivered bool
		quorum      bool
		want        int
	}{
		{nil, false, true, 1},
		{nil, true, true, 2},
		{nil, true, false, 2},
		{amqp.Table{rabbitmq.HeaderAttempt: int64(3)}, false, true, 3},
		{amqp.Table{rabbitmq.HeaderAttempt: int64(3)}, true, false, 4},
		{amqp.Table{"x-delivery-count": int64(2)}, true, true, 3},
		{amqp.Table{rabbitmq.HeaderAttempt: int32(4), "x-delivery-count": int64(1)}, true, true, 5},
		{amqp.Table{rabbitmq.HeaderAttempt: "garbage"}, false, true, 1},
		{amqp.Table{rabbitmq.HeaderAttempt: int64(-7)}, false, true, 1},
		{amqp.Table{"x-delivery-count": int64(7)}, false, false, 1},
		{amqp.Table{"x-delivery-count": int64(7)}, true, false, 2},
		{amqp.Table{"x-delivery-count": int64(7)}, false, true, 1},
	} {
		if got := rabbitmq.AttemptOf(c.h, c.redelivered, c.quorum); got != c.want {
			t.Errorf("attempt of %v (redelivered %v, quorum %v) = %d, want %d", c.h, c.redelivered, c.quorum, got, c.want)
		}
	}
}
