package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/rabbitmq"
)

// defaultRabbitMQURL is the broker --broker rabbitmq uses when
// IDEM_RABBITMQ_URL is unset.
const defaultRabbitMQURL = "amqp://guest:guest@127.0.0.1:5672/"

// rabbitDemo runs the demo over a RabbitMQ server: it needs one running
// (IDEM_RABBITMQ_URL), and uses a quorum queue of its own, deleted with
// its retry queues at the end.
type rabbitDemo struct {
	consumerSet
	url, queue string
}

func newRabbitDemo() (*rabbitDemo, error) {
	url := os.Getenv("IDEM_RABBITMQ_URL")
	if url == "" {
		url = defaultRabbitMQURL
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	d := &rabbitDemo{url: url, queue: "idem-demo-" + hex.EncodeToString(b)}
	conn, err := d.dial(nil)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ at %s (set IDEM_RABBITMQ_URL): %w", redactURL(url), err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ: %w", err)
	}
	if _, err := ch.QueueDeclare(d.queue, true, false, false, false, amqp.Table{"x-queue-type": rabbitmq.QueueQuorum}); err != nil {
		return nil, fmt.Errorf("RabbitMQ: declare queue %s: %w", d.queue, err)
	}
	return d, nil
}

// redactURL is url without its password.
func redactURL(url string) string {
	u, err := amqp.ParseURI(url)
	if err != nil {
		return "(unparsable URL)"
	}
	u.Password = "xxx"
	return u.String()
}

// dial connects; keep, when set, receives the TCP connection so that a
// kill can cut it.
func (d *rabbitDemo) dial(keep func(net.Conn)) (*amqp.Connection, error) {
	return amqp.DialConfig(d.url, d.amqpConfig(keep))
}

func (d *rabbitDemo) amqpConfig(keep func(net.Conn)) amqp.Config {
	dial := amqp.DefaultDial(5 * time.Second)
	return amqp.Config{
		Properties: amqp.Table{"connection_name": "idem demo " + d.queue},
		Dial: func(network, addr string) (net.Conn, error) {
			c, err := dial(network, addr)
			if err == nil && keep != nil {
				keep(c)
			}
			return c, err
		},
	}
}

func (d *rabbitDemo) describe() string {
	return fmt.Sprintf("the RabbitMQ server at %s, quorum queue %s, 3 consumers", redactURL(d.url), d.queue)
}

func (d *rabbitDemo) killNote() string {
	return "TCP connections cut mid-stream; RabbitMQ redelivered what they had not acknowledged"
}

// close deletes the demo's queue and its retry queues.
func (d *rabbitDemo) close() {
	conn, err := d.dial(nil)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	_, _ = ch.QueueDelete(d.queue, false, false, false)
	for _, tier := range rabbitmq.RetryTiers() {
		_, _ = ch.QueueDelete(rabbitmq.RetryQueueName(d.queue, tier), false, false, false)
	}
}

// publish sends every delivery with publisher confirms, the ID in the
// message-id property: a republished copy is a new message with the same
// ID, as a producer's retry would be.
func (d *rabbitDemo) publish(ctx context.Context, msgs []*idem.Message) error {
	conn, err := d.dial(nil)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	dcs := make([]*amqp.DeferredConfirmation, 0, len(msgs))
	for _, m := range msgs {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", d.queue, true, false, amqp.Publishing{
			MessageId: m.ID, Type: m.Type, Body: m.Payload, DeliveryMode: amqp.Persistent,
			Headers: amqp.Table{rabbitmq.HeaderAggregate: m.AggregateID},
		})
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		dcs = append(dcs, dc)
	}
	for _, dc := range dcs {
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		if !ok {
			return errors.New("publish: RabbitMQ refused a message")
		}
	}
	return nil
}

// start runs one more consumer of the queue, with its own connection.
// Killing it cuts its TCP connection, as a crash would.
func (d *rabbitDemo) start(ctx context.Context) error {
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	keep := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	c, err := rabbitmq.New(&rabbitmq.Config{URL: d.url, AMQP: d.amqpConfig(keep), Queue: d.queue, Handler: d.h,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(cctx) }()
	var once sync.Once
	d.add(func() {
		once.Do(func() {
			cancel()
			mu.Lock()
			for _, c := range conns {
				c.Close()
			}
			mu.Unlock()
			<-done
		})
	})
	return nil
}
