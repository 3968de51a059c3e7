package testenv

import (
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// DefaultNATSURL is used when IDEM_NATS_URL is unset.
const DefaultNATSURL = "nats://127.0.0.1:4222"

// NATSURL returns IDEM_NATS_URL or the default.
func NATSURL() string {
	if u := os.Getenv("IDEM_NATS_URL"); u != "" {
		return u
	}
	return DefaultNATSURL
}

// NATSConn connects to the NATS server (with JetStream) at NATSURL,
// skipping loudly when it is unreachable. The connection closes when t ends.
func NATSConn(t testing.TB) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(NATSURL(), nats.Timeout(3*time.Second))
	if err != nil {
		Unavailable(t, "NATS", NATSURL(), err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// EmbeddedNATS starts an in-process NATS server with JetStream, storing in
// a temporary directory, and returns its client URL. It shuts down when t
// ends.
func EmbeddedNATS(t testing.TB) string {
	t.Helper()
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("embedded NATS did not start")
	}
	t.Cleanup(ns.Shutdown)
	return ns.ClientURL()
}
