package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultRabbitMQURL is used when IDEM_RABBITMQ_URL is unset.
const DefaultRabbitMQURL = "amqp://guest:guest@127.0.0.1:5672/"

// RabbitMQURL returns IDEM_RABBITMQ_URL or the default.
func RabbitMQURL() string {
	if u := os.Getenv("IDEM_RABBITMQ_URL"); u != "" {
		return u
	}
	return DefaultRabbitMQURL
}

// RabbitMQ connects to the broker at RabbitMQURL, skipping loudly when it
// is unreachable, and returns the connection (closed when t ends) and a
// name prefix unique to the test, for its queues and exchanges.
func RabbitMQ(t testing.TB) (*amqp.Connection, string) {
	t.Helper()
	conn, err := amqp.DialConfig(RabbitMQURL(), amqp.Config{
		Properties: amqp.Table{"connection_name": "idem test " + t.Name()},
		Dial:       amqp.DefaultDial(3 * time.Second),
	})
	if err != nil {
		Unavailable(t, "RabbitMQ", RabbitMQURL(), err)
	}
	t.Cleanup(func() { conn.Close() })
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return conn, "idemtest." + hex.EncodeToString(b)
}
