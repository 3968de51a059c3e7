package jetstream

import (
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// gate is a TCP proxy to a NATS server whose server-to-client direction
// can be held: the connection stays up, but nothing the server sends
// (heartbeats included) reaches the client, as when the node serving a
// pull dies or the network drops its packets.
type gate struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	held   bool
	cond   *sync.Cond
}

func newGate(t *testing.T, target string) *gate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &gate{ln: ln, target: target}
	g.cond = sync.NewCond(&g.mu)
	t.Cleanup(func() { _ = ln.Close(); g.hold(false) })
	go g.accept()
	return g
}

func (g *gate) url() string { return "nats://" + g.ln.Addr().String() }

func (g *gate) hold(on bool) {
	g.mu.Lock()
	g.held = on
	g.mu.Unlock()
	g.cond.Broadcast()
}

func (g *gate) accept() {
	for {
		c, err := g.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", g.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		go func() { _, _ = io.Copy(s, c); _ = s.Close() }()
		go func() {
			defer c.Close()
			buf := make([]byte, 32<<10)
			for {
				n, err := s.Read(buf)
				g.mu.Lock()
				for g.held {
					g.cond.Wait()
				}
				g.mu.Unlock()
				if n > 0 {
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}

// A pull whose server goes quiet for longer than two heartbeats makes
// nats.go report ErrNoHeartbeat. Run pulls again instead of ending: a
// node's death in a cluster is not the consumer's failure, and a Run that
// returned would leave the replica consuming nothing until its owner
// restarted it.
func TestRunOutlivesMissedHeartbeats(t *testing.T) {
	server := testenv.EmbeddedNATS(t)
	g := newGate(t, strings.TrimPrefix(server, "nats://"))
	nc, err := nats.Connect(g.url())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := nats.Connect(server)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	pjs, err := jetstream.New(pub)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := pjs.CreateStream(ctx, jetstream.StreamConfig{Name: "HB", Subjects: []string{"hb.>"}}); err != nil {
		t.Fatal(err)
	}
	seen := make(chan string, 16)
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		seen <- d.Msg.ID
		return idem.Verdict{Ack: true}
	})
	c, err := New(js, &Config{Stream: "HB", Durable: "d", Handler: h, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	c.pullHeartbeat = 500 * time.Millisecond // the least nats.go allows
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()

	publish := func(id string) {
		t.Helper()
		m := nats.NewMsg("hb.x")
		m.Header.Set(nats.MsgIdHdr, id)
		m.Data = []byte(`{}`)
		if _, err := pjs.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	want := func(id string) {
		t.Helper()
		select {
		case got := <-seen:
			if got != id {
				t.Fatalf("handled %q, want %q", got, id)
			}
		case err := <-ran:
			t.Fatalf("Run ended before %s was handled: %v", id, err)
		case <-time.After(20 * time.Second):
			t.Fatalf("%s not handled within 20 s", id)
		}
	}
	publish("before")
	want("before")

	g.hold(true) // more than two heartbeats of silence
	time.Sleep(2500 * time.Millisecond)
	g.hold(false)

	publish("after")
	want("after")
	select {
	case err := <-ran:
		t.Fatalf("Run ended: %v", err)
	default:
	}
}
