package testenv

import (
	"net"
	"os"
	"strconv"
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
	return NewNATSServer(t).URL()
}

// NATSServer is an in-process NATS server with JetStream that a test can
// stop and start again on the same port and store, as a broker restart.
type NATSServer struct {
	t    testing.TB
	opts server.Options
	ns   *server.Server
}

// NewNATSServer starts a NATSServer on a free loopback port, storing in a
// temporary directory; it shuts down when t ends.
func NewNATSServer(t testing.TB) *NATSServer {
	t.Helper()
	s := &NATSServer{t: t, opts: server.Options{Host: "127.0.0.1", Port: freePort(t), JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true}}
	t.Cleanup(s.Stop)
	s.Start()
	return s
}

// Start starts the server and returns once it takes connections, its
// streams recovered from the store.
func (s *NATSServer) Start() {
	s.t.Helper()
	opts := s.opts
	ns, err := server.NewServer(&opts)
	if err != nil {
		s.t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		s.t.Fatal("embedded NATS did not start")
	}
	s.ns = ns
}

// Stop shuts the server down; stopping a stopped server does nothing.
func (s *NATSServer) Stop() {
	if s.ns == nil {
		return
	}
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
	s.ns = nil
}

// URL is the server's client URL.
func (s *NATSServer) URL() string {
	return "nats://" + net.JoinHostPort(s.opts.Host, strconv.Itoa(s.opts.Port))
}
