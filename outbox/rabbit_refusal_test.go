package outbox_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/rabbitmq"
)

// TestRabbitRefusalReasonIsRecorded: a row the broker refuses by
// closing the publisher's channel (an exchange that does not exist; a
// message over RabbitMQ's max_message_size, 128 MiB by default, alike)
// fails visibly with the broker's reason as its last error, is
// not taken for an outage, and its key's later row waits. Before, the
// last error said only "channel/connection is not open".
func TestRabbitRefusalReasonIsRecorded(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, exchange, want string
		payload              []byte
		stream               string
	}{
		{"unroutable", "", "unroutable", []byte("1"), "idem-test-no-such-queue"},
		{"missing-exchange", "idem-test-no-such-exchange", "NOT_FOUND", []byte("1"), ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			p := sqliteProducer(t)
			b := newRabbitBroker(t)
			pub, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: testenv.RabbitMQURL(), Exchange: c.exchange})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { pub.Close() })
			a1 := &idem.Message{ID: "a-1", Stream: b.stream(), AggregateID: "acct-a", Seq: 1, Payload: c.payload}
			if c.stream != "" {
				a1.Stream = c.stream
			}
			a2 := &idem.Message{ID: "a-2", Stream: b.stream(), AggregateID: "acct-a", Seq: 2, Payload: []byte("2")}
			if err := p.add(ctx, a1, a2); err != nil {
				t.Fatalf("add: %v", err)
			}
			logs := &testenv.Buffer{}
			r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "r1", Backoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 100 * time.Millisecond},
				Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			for range 2 {
				_, _ = r.RunOnce(ctx)
				time.Sleep(100 * time.Millisecond)
			}
			if strings.Contains(logs.String(), "broker unreachable") {
				t.Errorf("a refusal was taken for a broker outage:\n%s", logs.String())
			}
			rows := unpublished(t, p)
			if len(rows) != 2 {
				t.Fatalf("%d rows unpublished, want a-1 and a-2", len(rows))
			}
			f, w := rows[0], rows[1]
			t.Logf("a-1: %s, %d attempts, %q", f.State, f.Attempts, f.LastError)
			if f.State != driver.OutboxFailing || !strings.Contains(f.LastError, c.want) {
				t.Errorf("a-1 %s with last error %q; want failing with the broker's reason (%q)", f.State, f.LastError, c.want)
			}
			if w.State != driver.OutboxPending || w.Attempts != 0 {
				t.Errorf("a-2 %s with %d attempts; want pending, waiting", w.State, w.Attempts)
			}
		})
	}
}
