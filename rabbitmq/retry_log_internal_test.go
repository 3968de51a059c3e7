package rabbitmq

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// A broker that refuses every retry copy (here: the retry channel is
// gone) makes every retried message fail alike. One line tells the
// operator; one per message would bury it. Each message still goes back
// to its queue.
func TestRetryCopyFailuresAreSummarized(t *testing.T) {
	conn, prefix := testenv.RabbitMQ(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	queue := prefix + ".work"
	if _, err := ch.QueueDeclare(queue, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		if err := ch.PublishWithContext(context.Background(), "", queue, true, false,
			amqp.Publishing{MessageId: "m" + string(rune('a'+i)), Body: []byte("{}")}); err != nil {
			t.Fatal(err)
		}
	}
	msgs, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}

	logs := &testenv.Buffer{}
	c, err := New(&Config{URL: testenv.RabbitMQURL(), Queue: queue, QueueType: QueueClassic,
		Handler: idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{} }),
		Logger:  slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	rt, err := newRetrier(conn, queue, QueueClassic)
	if err != nil {
		t.Fatal(err)
	}
	_ = rt.ch.Close() // every copy now fails
	s := &session{c: c, ch: ch, rt: rt, stopping: make(chan struct{})}

	timeout := time.After(10 * time.Second)
	for range n {
		var m amqp.Delivery
		select {
		case m = <-msgs:
		case <-timeout:
			t.Fatal("the test's messages did not arrive")
		}
		s.settle(pending{m: &m, d: c.delivery(&m, s.stopping)}, idem.Verdict{RetryAfter: time.Millisecond})
	}

	if got := strings.Count(logs.String(), "retry copy not confirmed"); got != 1 {
		t.Errorf("%d copies refused wrote %d lines, want 1:\n%s", n, got, logs.String())
	}
	// Each refused copy's message went back to the queue, not lost.
	for range n {
		select {
		case m := <-msgs:
			if !m.Redelivered {
				t.Errorf("message %s: a new delivery, want the one handed back", m.MessageId)
			}
		case <-timeout:
			t.Fatal("a message whose copy was refused did not come back to its queue")
		}
	}
}
