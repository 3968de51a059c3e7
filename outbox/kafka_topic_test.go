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
)

// TestKafkaUnusableTopicIsVisible: a row for a topic the cluster does
// not have (or cannot have) fails visibly with a reason, is not taken for
// an outage, its key's later row waits and another key's row goes out.
func TestKafkaUnusableTopicIsVisible(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, topic string }{
		{"missing", "no-such-topic"},
		{"invalid-chars", "bad/topic"},
		{"too-long", strings.Repeat("t", 250)},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			p := sqliteProducer(t)
			b := newKafkaBroker(t)
			a1 := &idem.Message{ID: "a-1", Stream: c.topic, AggregateID: "acct-a", Seq: 1, Payload: []byte("1")}
			a2 := &idem.Message{ID: "a-2", Stream: b.stream(), AggregateID: "acct-a", Seq: 2, Payload: []byte("2")}
			b1 := &idem.Message{ID: "b-1", Stream: b.stream(), AggregateID: "acct-b", Seq: 1, Payload: []byte("3")}
			if err := p.add(ctx, a1, a2, b1); err != nil {
				t.Fatalf("add: %v", err)
			}
			logs := &testenv.Buffer{}
			r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r1", ClaimTTL: 2 * time.Second, PollInterval: 50 * time.Millisecond,
				Backoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 100 * time.Millisecond}, Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			rctx, stop := context.WithTimeout(ctx, 3*time.Second)
			defer stop()
			start := time.Now()
			_ = r.Run(rctx)
			if d := time.Since(start); d > 6*time.Second {
				t.Errorf("Run took %s to stop", d)
			}
			if strings.Contains(logs.String(), "broker unreachable") {
				t.Errorf("taken for a broker outage:\n%s", logs.String())
			}
			rows := unpublished(t, p)
			for _, e := range rows {
				t.Logf("%s: %s, %d attempts, %.300q", e.MessageID, e.State, e.Attempts, e.LastError)
			}
			if len(rows) != 2 || rows[0].State != driver.OutboxFailing || rows[0].LastError == "" || rows[1].Attempts != 0 {
				t.Fatalf("want a-1 failing with a reason and a-2 waiting; got %d rows", len(rows))
			}
			// A name Kafka never takes is refused at once, with the reason,
			// not after a produce that waits out nine tenths of the claim
			// (every cycle holding it stalls the relay's other keys).
			if c.name != "missing" {
				if e := rows[0]; e.Attempts < 5 || !strings.Contains(e.LastError, "invalid message") {
					t.Errorf("a-1 to topic %.20q: %d attempts in 3 s, last error %q; want it refused at once as an invalid message", c.topic, e.Attempts, e.LastError)
				}
			}
		})
	}
}
