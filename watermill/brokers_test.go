package watermill_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/testenv"
)

// amqpURL returns IDEM_RABBITMQ_URL or its default, as the rabbitmq
// package's tests use.
func amqpURL() string { return testenv.RabbitMQURL() }

// broker is one Watermill pub/sub on a real server: a publisher, and
// subscribers that share the topic's messages (competing consumers).
type broker struct {
	name   string
	topic  string
	pub    message.Publisher
	newSub func(t testing.TB) message.Subscriber
}

// amqpConfig is a durable queue named after the topic, with publisher
// confirms: Publish returns once RabbitMQ has the message.
func amqpConfig() amqp.Config {
	cfg := amqp.NewDurableQueueConfig(amqpURL())
	cfg.Publish.ConfirmDelivery = true
	cfg.Consume.Qos.PrefetchCount = 16
	return cfg
}

// newAMQPBroker declares a fresh durable queue on the machine's RabbitMQ
// (deleted when t ends; create is false in a child process, which attaches
// to its parent's queue).
func newAMQPBroker(t testing.TB, topic string, create bool) *broker {
	t.Helper()
	conn, err := amqp091.Dial(amqpURL())
	if err != nil {
		testenv.Unavailable(t, "RabbitMQ", amqpURL(), err)
	}
	t.Cleanup(func() { conn.Close() })
	if create {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclare(topic, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ch, err := conn.Channel()
			if err == nil {
				_, err = ch.QueueDelete(topic, false, false, false)
			}
			if err != nil {
				t.Errorf("delete queue %s: %v", topic, err)
			}
		})
	}
	pub, err := amqp.NewPublisher(amqpConfig(), wmLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return &broker{name: "amqp", topic: topic, pub: pub, newSub: func(t testing.TB) message.Subscriber {
		sub, err := amqp.NewSubscriber(amqpConfig(), wmLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sub.Close() })
		return sub
	}}
}

// sqlSchema keeps a topic's messages and offsets in schema (a test's
// fresh one, dropped with it), with BYTEA payloads: the default column is
// JSON, and the test payloads are not.
func sqlSchema(schema string) (wmsql.DefaultPostgreSQLSchema, wmsql.DefaultPostgreSQLOffsetsAdapter) {
	return wmsql.DefaultPostgreSQLSchema{
			GenerateMessagesTableName: func(topic string) string { return pgx.Identifier{schema, "watermill_" + topic}.Sanitize() },
			GeneratePayloadType:       func(string) string { return "BYTEA" },
		}, wmsql.DefaultPostgreSQLOffsetsAdapter{
			GenerateMessagesOffsetsTableName: func(topic string) string {
				return pgx.Identifier{schema, "watermill_offsets_" + topic}.Sanitize()
			},
		}
}

// newSQLBroker is watermill-sql on Postgres, its tables in schema;
// subscribers share one consumer group.
func newSQLBroker(t testing.TB, pool *pgxpool.Pool, schema, topic string) *broker {
	t.Helper()
	sa, oa := sqlSchema(schema)
	pub, err := wmsql.NewPublisher(wmsql.BeginnerFromPgx(pool), wmsql.PublisherConfig{SchemaAdapter: sa, AutoInitializeSchema: true}, wmLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return &broker{name: "sql", topic: topic, pub: pub, newSub: func(t testing.TB) message.Subscriber {
		sub, err := wmsql.NewSubscriber(wmsql.BeginnerFromPgx(pool), wmsql.SubscriberConfig{
			ConsumerGroup: "balances", SchemaAdapter: sa, OffsetsAdapter: oa, InitializeSchema: true,
			PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond, RetryInterval: 20 * time.Millisecond,
		}, wmLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sub.Close() })
		return sub
	}}
}

// initSQLTopic creates the topic's tables before anything publishes or
// subscribes.
func initSQLTopic(t testing.TB, b *broker) {
	t.Helper()
	sub := b.newSub(t)
	if si, ok := sub.(message.SubscribeInitializer); ok {
		if err := si.SubscribeInitialize(b.topic); err != nil {
			t.Fatal(err)
		}
	}
	_ = sub.Close()
}

// brokerFor returns the named broker for e's schema; create declares its
// topic (false in a child process).
func brokerFor(t testing.TB, name string, e *pgEnv, topic string, create bool) *broker {
	t.Helper()
	switch name {
	case "amqp":
		return newAMQPBroker(t, topic, create)
	case "sql":
		b := newSQLBroker(t, e.pool, e.schema, topic)
		if create {
			initSQLTopic(t, b)
		}
		return b
	}
	t.Fatalf("unknown broker %q", name)
	return nil
}
