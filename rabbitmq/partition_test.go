package rabbitmq_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/rabbitmq"
)

// proxy forwards TCP connections to the broker of IDEM_RABBITMQ_URL until
// partition is called: from then on it forwards nothing either way, and
// answers nothing, while it keeps the sockets open, as a network
// partition does. A proxy made silent answers nothing from the start.
type proxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	silent bool
	stall  chan struct{} // closed: nothing more is read from the clients connected so far
	conns  []net.Conn
}

func newProxy(t testing.TB, silent bool) *proxy {
	t.Helper()
	u, err := amqp.ParseURI(testenv.RabbitMQURL())
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: net.JoinHostPort(u.Host, strconv.Itoa(u.Port)), silent: silent, stall: make(chan struct{})}
	t.Cleanup(p.close)
	go p.accept()
	return p
}

func (p *proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.conns = append(p.conns, c)
		silent := p.silent
		p.mu.Unlock()
		if silent {
			go func() { _, _ = io.Copy(io.Discard, c) }()
			continue
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, u)
		stall := p.stall
		p.mu.Unlock()
		go p.pipe(c, u, stall)
		go p.pipe(u, c, nil)
	}
}

// pipe copies from to to, dropping what it reads once the proxy is
// silent. Once stall is closed it forwards nothing more and stops reading.
func (p *proxy) pipe(from, to net.Conn, stall chan struct{}) {
	buf := make([]byte, 32<<10)
	for {
		n, err := from.Read(buf)
		if err != nil {
			return
		}
		select {
		case <-stall:
			return
		default:
		}
		p.mu.Lock()
		silent := p.silent
		p.mu.Unlock()
		if silent {
			continue
		}
		if _, err := to.Write(buf[:n]); err != nil {
			return
		}
	}
}

// stallClients stops reading from the clients connected so far, keeping
// their sockets open: as a broker under a memory or disk alarm does (it
// blocks the publishing connections), their writes block once the socket
// buffers are full. Later connections are forwarded.
func (p *proxy) stallClients() {
	p.mu.Lock()
	close(p.stall)
	p.stall = make(chan struct{})
	p.mu.Unlock()
}

func (p *proxy) partition() {
	p.mu.Lock()
	p.silent = true
	p.mu.Unlock()
}

// close ends the partition the hard way: every socket closed, so that the
// broker returns what the cut connections had not acknowledged.
func (p *proxy) close() {
	p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

func (p *proxy) url() string { return "amqp://guest:guest@" + p.ln.Addr().String() + "/" }

// A stop while Run connects to a broker that accepts the TCP connection
// but answers nothing returns at once: before, it waited for amqp091's
// handshake timeout (30 s), since the dial did not watch Run's context.
func TestStopWhileConnectingToASilentBroker(t *testing.T) {
	t.Parallel()
	p := newProxy(t, true)
	c, err := rabbitmq.New(&rabbitmq.Config{URL: p.url(), Queue: "q", Logger: testenv.Logger(t),
		Handler: idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = c.Run(ctx)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run returned %v, want the context's deadline", err)
	}
	if took > 3*time.Second {
		t.Fatalf("Run returned %s after it was started, %s after its context ended: the stop waited for the handshake to time out", took, took-300*time.Millisecond)
	}
	// Lag too answers within its context.
	lagCtx, lagCancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer lagCancel()
	start = time.Now()
	if _, err := c.Lag(lagCtx); err == nil || time.Since(start) > 3*time.Second {
		t.Fatalf("Lag on a silent broker returned %v after %s, want an error within its 300 ms context", err, time.Since(start))
	}
	// And the Publisher's probe, which an outbox relay bounds by 2 s.
	pub, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: p.url()})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	probeCtx, probeCancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer probeCancel()
	start = time.Now()
	if err := pub.Probe(probeCtx); err == nil || time.Since(start) > 3*time.Second {
		t.Fatalf("Probe of a silent broker returned %v after %s, want an error within its 300 ms context", err, time.Since(start))
	}
}

// A stop during a network partition (the proxy between the consumer and
// the broker forwards nothing any more) returns within the bound of the
// consumer's cancel (5 s), not once the heartbeats time out (here 3 × 20
// s): the connection is given up. Once the partition ends, a new consumer
// finishes the balances exactly.
func TestStopDuringPartitionIsBounded(t *testing.T) {
	t.Parallel()
	b, e := newBroker(t, rabbitmq.QueueQuorum), adaptertest.NewEnv(t)
	p := newProxy(t, false)
	events := idemtest.Events(300)
	b.Publish(t, adaptertest.Messages(events), 0)
	inner := e.Consumer(false)
	cfg := b.config(t, idem.DeliveryHandlerFunc(func(ctx context.Context, d *idem.Delivery) idem.Verdict {
		time.Sleep(5 * time.Millisecond)
		return inner.HandleDelivery(ctx, d)
	}))
	cfg.URL = p.url()
	cfg.AMQP.Heartbeat = 20 * time.Second
	_, stop := run(t, cfg)
	e.WaitMarkers(50)
	p.partition()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	if err := stop(false); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run returned %v, want context.Canceled", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("the stop took %s during the partition, want about 5 s", took)
	}
	p.close()
	b.Start(t, e.Consumer(false))
	e.WaitMarkers(len(events))
	e.CheckBalances(events)
}

// TestLagDuringPartitionIsBounded: Lag asked on a running consumer's
// connection while the network path to the broker is dead answers when
// its context ends, with the context's error. Opening the channel for
// the declare waited for the broker regardless of the context, until the
// heartbeats failed (here 3 × 20 s): a metrics scrape hung that long.
func TestLagDuringPartitionIsBounded(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	p := newProxy(t, false)
	consuming := make(chan struct{})
	var once sync.Once
	ack := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		once.Do(func() { close(consuming) })
		return idem.Verdict{Ack: true}
	})
	cfg := b.config(t, ack)
	cfg.URL = p.url()
	cfg.AMQP.Heartbeat = 20 * time.Second
	c, stop := run(t, cfg)
	defer func() { _ = stop(false) }()
	// A delivery handled: the consumer's session is up and consuming, so
	// Lag asks on its connection. (A Lag that merely succeeds may have
	// dialled a connection of its own while the session was still being
	// set up, which then could end before the partition.)
	b.Publish(t, adaptertest.Messages(idemtest.Events(1)), 0)
	select {
	case <-consuming:
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer handled no delivery in 30 s")
	}
	if _, err := c.Lag(context.Background()); err != nil {
		t.Fatalf("Lag of the running consumer: %v", err)
	}
	p.partition()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Lag(ctx)
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("Lag took %s during the partition, want about its context's 500 ms", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Lag returned %v, want the context's deadline", err)
	}
}

// A broker that stops reading from the publisher (a memory or disk alarm
// blocks publishing connections) leaves a Publish waiting: for its write,
// once the socket buffers are full, or for confirms that never come and
// then for the close of its channel. The end of its context still ends
// it, so a relay stops when asked, and the next Publish connects again;
// Close ends a stuck Publish too, and does not wait for the broker for
// ever.
func TestPublishReturnsWhenBrokerStopsReading(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	ctx := context.Background()
	big := make([]byte, 1<<20)
	for _, size := range []struct {
		name string
		msgs []*idem.Message
	}{
		{"one small message", []*idem.Message{{ID: "small", Stream: b.queue, Payload: []byte("s")}}},
		{"32 MiB", func() (msgs []*idem.Message) {
			for i := range 32 { // more than any socket buffer holds
				msgs = append(msgs, &idem.Message{ID: "big-" + strconv.Itoa(i), Stream: b.queue, Payload: big})
			}
			return msgs
		}()},
	} {
		px := newProxy(t, false)
		p, err := rabbitmq.NewPublisher(&rabbitmq.PublisherConfig{URL: px.url()})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Publish(ctx, []*idem.Message{{ID: "first", Stream: b.queue, Payload: []byte("1")}}); err != nil {
			t.Fatal(err)
		}
		px.stallClients()
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		done := make(chan error, 1)
		go func() { done <- p.Publish(pctx, size.msgs) }()
		select {
		case err := <-done:
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("%s: Publish to a broker that reads nothing: %v, want the context's error", size.name, err)
			}
			t.Logf("%s: Publish returned %v", size.name, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: Publish still blocked 9 s after its context ended", size.name)
		}
		cancel()
		if err := p.Publish(ctx, []*idem.Message{{ID: "after", Stream: b.queue, Payload: []byte("2")}}); err != nil {
			t.Fatalf("%s: Publish on a new connection: %v", size.name, err)
		}

		px.stallClients()
		go func() { done <- p.Publish(ctx, size.msgs) }() // no deadline
		time.Sleep(500 * time.Millisecond)
		closed := make(chan error, 1)
		start := time.Now()
		go func() { closed <- p.Close() }()
		for _, what := range []string{"Close", "the Publish Close interrupted"} {
			select {
			case <-closed:
				closed = nil
			case err := <-done:
				if err == nil {
					t.Fatalf("%s: Publish to a broker that reads nothing succeeded", size.name)
				}
				done = nil
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: %s still blocked 10 s after Close", size.name, what)
			}
		}
		t.Logf("%s: Close and the stuck Publish returned in %s", size.name, time.Since(start).Round(time.Millisecond))
	}
}

// A Publish whose context ends while the broker reads returns at once and
// leaves the connection to the other calls: only a call still running a
// second after its context ended takes the broker for one that stopped
// reading and closes the connection.
func TestCancelledPublishesLeaveTheConnection(t *testing.T) {
	t.Parallel()
	b := newBroker(t, rabbitmq.QueueQuorum)
	p := newPublisherURL(t, testenv.RabbitMQURL())
	ctx := context.Background()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // callers whose contexts end, some before the call
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			cctx, cancel := context.WithTimeout(ctx, time.Duration(i%4)*500*time.Microsecond)
			_ = p.Publish(cctx, []*idem.Message{{ID: "c-" + strconv.Itoa(i), Stream: b.queue, Payload: []byte("c")}})
			cancel()
		}
	}()
	for i := range 300 {
		if err := p.Publish(ctx, []*idem.Message{{ID: "k-" + strconv.Itoa(i), Stream: b.queue, Payload: []byte("k")}}); err != nil {
			close(stop)
			wg.Wait()
			t.Fatalf("publish %d, beside cancelled ones: %v", i, err)
		}
	}
	close(stop)
	wg.Wait()
}
