package outbox_test

import (
	"context"
	"fmt"
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

// TestRabbitAlarmIsAnOutage: a RabbitMQ node under a memory alarm stops
// reading from the connections that publish (a disk alarm alike), and
// says so with connection.blocked. That is the broker out of reach, not
// the rows' failure: no attempt counted on them while it lasts, one
// line saying so, and every row published once the alarm clears. The
// relay's user may write to its exchange only: the publisher's probe,
// which publishes to the default exchange after an alarm, is refused,
// and a refusal is the broker answering (it once kept the relay paused
// for ever).
func TestRabbitAlarmIsAnOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewRabbitMQServer(t)
	const queue = "credits"
	srv.DeclareQueue(queue)
	srv.Bind(queue, "amq.direct", queue)
	url := srv.AddUser("relay", "relay", "^$", `^amq\.direct$`, "^$")
	pub, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: url, Exchange: "amq.direct"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	p := sqliteProducer(t)
	logs := &testenv.Buffer{}
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "r1", ClaimTTL: 2 * time.Second, PollInterval: 50 * time.Millisecond,
		Backoff: idem.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	msg := func(key string, seq int64) *idem.Message {
		return &idem.Message{ID: fmt.Sprintf("%s-%d", key, seq), Stream: queue, AggregateID: key, Seq: seq, Payload: []byte("1")}
	}
	if err := p.add(ctx, msg("a", 1)); err != nil {
		t.Fatal(err)
	}
	if res, err := r.RunOnce(ctx); err != nil || res.Published != 1 {
		t.Fatalf("before the alarm: %+v, %v; want a-1 published", res, err)
	}

	srv.MemoryAlarm(true)
	want := 1
	for _, key := range []string{"a", "b", "c"} {
		for seq := int64(2); seq <= 3; seq++ {
			if err := p.add(ctx, msg(key, seq)); err != nil {
				t.Fatal(err)
			}
			want++
		}
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	time.Sleep(5 * time.Second) // cycles of a 2 s claim
	for _, row := range unpublished(t, p) {
		if row.Attempts != 0 || row.State != driver.OutboxPending {
			t.Errorf("during the alarm %s is %s after %d attempts (%q); want pending, no attempt", row.MessageID, row.State, row.Attempts, row.LastError)
		}
	}
	if !strings.Contains(logs.String(), "broker unreachable") {
		t.Errorf("no line says the broker is out of reach:\n%s", logs.String())
	}

	srv.MemoryAlarm(false)
	for deadline := time.Now().Add(20 * time.Second); len(unpublished(t, p)) > 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("rows still unpublished 20 s after the alarm cleared: %+v", unpublished(t, p))
		}
	}
	stop()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run went on 10 s after its stop")
	}
	if n := srv.Messages(queue); n < want {
		t.Fatalf("%d messages in the queue; want at least %d (every row, some maybe twice)", n, want)
	}
}
