package rabbitmq

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// TestProbeAfterAlarmOnLockedDownVhost: after an alarm seen on a
// connection since cut, Probe publishes to the default exchange; a user
// who may write to its own exchange only is refused there. A refusal is
// the broker answering: the probe passes once the alarm is over. It used
// to fail for good, keeping the outbox relay paused although the broker
// took publishes again.
func TestProbeAfterAlarmOnLockedDownVhost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewRabbitMQServer(t)
	srv.DeclareQueue("q")
	srv.Bind("q", "amq.direct", "q")
	p, err := NewPublisher(&PublisherConfig{URL: srv.AddUser("relay", "relay", "^$", `^amq\.direct$`, "^$"), Exchange: "amq.direct"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	msg := func(id string) []*idem.Message { return []*idem.Message{{ID: id, Stream: "q", Payload: []byte(id)}} }
	if err := p.Publish(ctx, msg("m1")); err != nil {
		t.Fatal(err)
	}
	srv.MemoryAlarm(true)
	for deadline := time.Now().Add(10 * time.Second); !p.alarm.Load(); {
		_ = p.Publish(ctx, msg("m2"))
		if time.Now().After(deadline) {
			t.Fatal("no connection.blocked 10 s into the alarm")
		}
	}
	probe := func() error {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		return p.Probe(pctx)
	}
	if err := probe(); !errors.Is(err, ErrBlocked) {
		t.Fatalf("Probe during the alarm: %v; want ErrBlocked", err)
	}
	p.sock.Load().close() // the connection is lost before the broker unblocks it
	srv.MemoryAlarm(false)
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := probe()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Probe 15 s after the alarm cleared: %v", err)
		}
	}
	if err := p.Publish(ctx, msg("m3")); err != nil {
		t.Fatalf("Publish after the alarm: %v", err)
	}
}
