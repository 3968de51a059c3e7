package kafka_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/kafka"
)

// freezer is a kfake listener whose connections, from freeze on, read a
// request and never answer it, nor accept new ones: a frozen broker, or a
// network path that drops everything, with no reset.
type freezer struct {
	net.Listener
	once   sync.Once
	frozen chan struct{} // closed by freeze
	thawed chan struct{} // closed by thaw
}

func newFreezer(network, address string) (*freezer, error) {
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	return &freezer{Listener: ln, frozen: make(chan struct{}), thawed: make(chan struct{})}, nil
}

func (f *freezer) freeze() { close(f.frozen) }
func (f *freezer) thaw()   { f.once.Do(func() { close(f.thawed) }) }

// hold blocks from the freeze to the thaw.
func (f *freezer) hold() {
	select {
	case <-f.frozen:
		<-f.thawed
	default:
	}
}

func (f *freezer) Accept() (net.Conn, error) {
	c, err := f.Listener.Accept()
	if err != nil {
		return nil, err
	}
	f.hold()
	return &frozenConn{Conn: c, f: f}, nil
}

type frozenConn struct {
	net.Conn
	f *freezer
}

func (c *frozenConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.f.hold()
	return n, err
}

// TestStopWhileTheClusterHangs: Run's context ends as the cluster stops
// answering, between a poll's records and their commit. The commit and
// the group leave are cut StopTimeout later and Run returns the
// context's error; it used to wait on them for as long as the client
// retried (over 90 s here).
func TestStopWhileTheClusterHangs(t *testing.T) {
	t.Parallel()
	var f *freezer
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic), kfake.ListenFn(func(network, address string) (net.Listener, error) {
		var err error
		f, err = newFreezer(network, address)
		return f, err
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.thaw(); cluster.Close() })
	b := &broker{addrs: cluster.ListenAddrs()}
	b.produce(t, []*kgo.Record{{Key: []byte("k"), Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("m1")}}}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var (
		once    sync.Once
		stopped time.Time
	)
	c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "g", Topics: []string{topic}, StopTimeout: 500 * time.Millisecond,
		Handler: idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} }),
		FaultHook: func(string) {
			once.Do(func() { f.freeze(); stopped = time.Now(); cancel() })
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case err := <-done:
		took := time.Since(stopped)
		t.Logf("Run returned %s after the stop (StopTimeout 500ms)", took)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Run: %v; want the context's end", err)
		}
		if stopped.IsZero() {
			t.Fatal("Run returned before the first commit")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run still running 30 s after its context ended on a hung cluster (StopTimeout 500 ms)")
	}
	if _, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "g", Topics: []string{topic}, StopTimeout: -time.Second,
		Handler: idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("a negative StopTimeout: %v; want ErrInvalidConfig", err)
	}
}
