package jetstream_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
)

// TestTrimmedIDWarned: NATS trims white space around header values, so a
// producer's ID " order-1 " travels as "order-1" and the stream's duplicate
// window drops a second message whose ID is "order-1". A Map that reads
// the ID from the payload sees both; the consumer logs a warning for the
// message whose ID the header no longer matches, and for no other.
func TestTrimmedIDWarned(t *testing.T) {
	t.Parallel()
	b := newBroker(t, testenv.EmbeddedNATS(t))
	msg := func(header, id string) *nats.Msg {
		payload, err := json.Marshal(map[string]string{"id": id})
		if err != nil {
			t.Fatal(err)
		}
		m := &nats.Msg{Subject: b.stream + ".orders", Data: payload, Header: nats.Header{}}
		m.Header.Set(header, id)
		return m
	}
	nc, js := b.connect(t)
	defer nc.Close()
	ctx := context.Background()
	for _, tc := range []struct {
		m   *nats.Msg
		dup bool
	}{
		{msg(jetstream.HeaderMsgID, " order-1 "), false},
		// The trimmed form of the first ID: the duplicate window drops it.
		{msg(jetstream.HeaderMsgID, "order-1"), true},
		{msg(jetstream.HeaderMsgID, "order-2"), false},
		{msg(jetstream.HeaderID, "order-3\n"), false},
	} {
		ack, err := js.PublishMsg(ctx, tc.m)
		if err != nil {
			t.Fatal(err)
		}
		if ack.Duplicate != tc.dup {
			t.Fatalf("publishing %q: Duplicate %v, want %v", tc.m.Data, ack.Duplicate, tc.dup)
		}
	}
	// A message whose payload ID differs from its header by more than
	// white space is the Map's own choice, not a trimmed ID.
	other := msg(jetstream.HeaderID, "order-4")
	other.Data = []byte(`{"id":"order-4b"}`)
	if _, err := js.PublishMsg(ctx, other); err != nil {
		t.Fatal(err)
	}

	var (
		logs testenv.Buffer
		mu   sync.Mutex
		seen []string
	)
	payloadID := func(m natsjs.Msg) (*idem.Message, error) {
		var p struct{ ID string }
		if err := json.Unmarshal(m.Data(), &p); err != nil {
			return nil, err
		}
		return &idem.Message{ID: p.ID, Stream: m.Subject(), Payload: m.Data()}, nil
	}
	h := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, d.Msg.ID)
		return idem.Verdict{Ack: true}
	})
	nc2, js2 := b.connect(t)
	defer nc2.Close()
	c, err := jetstream.New(js2, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: h, Map: payloadID,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	defer func() { cancel(); <-done }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		mu.Lock()
		n := len(seen)
		mu.Unlock()
		if n == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("handled %q, want 4 messages", seen)
		}
	}
	var warned []string
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		if strings.Contains(line, "level=WARN") {
			warned = append(warned, line)
		}
	}
	if len(warned) != 2 || !strings.Contains(warned[0], `id=" order-1 "`) || !strings.Contains(warned[0], "header=Nats-Msg-Id") ||
		!strings.Contains(warned[1], `id="order-3\n"`) || !strings.Contains(warned[1], "header=idem-id") {
		t.Fatalf("warnings:\n%s\nwant one for \" order-1 \" (Nats-Msg-Id) and one for \"order-3\\n\" (idem-id)", strings.Join(warned, "\n"))
	}
}

// TestTrimmedIDWarnedOncePerInterval: a producer that pads its IDs pads
// every one of them. The consumer warns once and counts the rest, rather
// than writing a line per message.
func TestTrimmedIDWarnedOncePerInterval(t *testing.T) {
	t.Parallel()
	b := newBroker(t, testenv.EmbeddedNATS(t))
	const n = 30
	var msgs []*nats.Msg
	for i := range n {
		id := fmt.Sprintf("order-%d ", i)
		payload, err := json.Marshal(map[string]string{"id": id})
		if err != nil {
			t.Fatal(err)
		}
		m := &nats.Msg{Subject: b.stream + ".orders", Data: payload, Header: nats.Header{}}
		m.Header.Set(jetstream.HeaderMsgID, id)
		msgs = append(msgs, m)
	}
	b.send(t, msgs)
	var (
		logs    testenv.Buffer
		handled atomic.Int64
	)
	payloadID := func(m natsjs.Msg) (*idem.Message, error) {
		var p struct{ ID string }
		if err := json.Unmarshal(m.Data(), &p); err != nil {
			return nil, err
		}
		return &idem.Message{ID: p.ID, Stream: m.Subject(), Payload: m.Data()}, nil
	}
	h := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
		handled.Add(1)
		return idem.Verdict{Ack: true}
	})
	nc, js := b.connect(t)
	defer nc.Close()
	c, err := jetstream.New(js, &jetstream.Config{Stream: b.stream, Durable: "idem", Handler: h, Map: payloadID,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	for deadline := time.Now().Add(10 * time.Second); handled.Load() < n; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("handled %d of %d messages", handled.Load(), n)
		}
	}
	if w := strings.Count(logs.String(), "level=WARN"); w != 1 {
		t.Fatalf("%d warnings for %d padded IDs, want 1:\n%s", w, n, logs.String())
	}
}
