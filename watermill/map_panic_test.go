package watermill_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	idemwm "github.com/idemhq/idem/watermill"
)

// A Config.Map that panics on a hostile payload (a poison message) makes
// the delivery a decode failure, dead-lettered with the reason and
// acknowledged, like a Map that returns an error: a panic out of Handle
// would end the process (or, through a Recoverer and a PoisonQueue, move
// the message out of idem's dead-letter store), and every redelivery
// would do it again.
func TestMapPanicIsADecodeFailure(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{}, nil)
	h, err := idemwm.New(e.c, &idemwm.Config{Map: func(msg *message.Message) (*idem.Message, error) {
		if string(msg.Payload) == "boom" {
			var fields []string
			_ = fields[3] // the kind of bug a hostile payload finds
		}
		return idemwm.DefaultMap(msg)
	}})
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("Handle panicked: %v", r)
			}
		}()
		if err := h.Handle(message.NewMessage("evt-boom", []byte("boom"))); err != nil {
			t.Fatalf("Handle: %v, want nil (dead-lettered, acknowledged)", err)
		}
		if err := h.Handle(message.NewMessage("evt-ok", []byte("ok"))); err != nil {
			t.Fatalf("Handle: %v, want nil (applied)", err)
		}
	}()
	dls := e.deadLetters(t)
	if len(dls) != 1 || dls[0].Class != idem.DeadLetterDecode || !strings.Contains(dls[0].Error, "panic") || string(dls[0].Raw) != "boom" {
		t.Fatalf("dead letters %+v, want evt-boom's payload as one decode failure naming the panic", dls)
	}
	if n := e.seen(t); n != 1 {
		t.Fatalf("%d rows applied, want 1 (evt-ok)", n)
	}
}

// A Map that panics on every message of a poison producer logs one line
// (with its stack) per interval, not one per message; each message is
// still dead-lettered with the reason.
func TestMapPanicLoggedOncePerInterval(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{}, nil)
	var buf testenv.Buffer
	h, err := idemwm.New(e.c, &idemwm.Config{Logger: slog.New(slog.NewTextHandler(&buf, nil)),
		Map: func(*message.Message) (*idem.Message, error) { panic("boom") }})
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	for i := range n {
		if err := h.Handle(message.NewMessage(fmt.Sprintf("evt-%d", i), []byte("x"))); err != nil {
			t.Fatalf("Handle: %v, want nil (dead-lettered)", err)
		}
	}
	if got := strings.Count(buf.String(), "Config.Map panicked"); got != 1 {
		t.Fatalf("%d lines about the panic for %d messages, want 1", got, n)
	}
	if dls := e.deadLetters(t); len(dls) != n {
		t.Fatalf("%d dead letters, want %d", len(dls), n)
	}
}

// A Map that returns neither a message nor an error hands the
// DeliveryHandler a DecodeErr matching idem.ErrInvalidMessage, as
// idem.Delivery promises for a message that could not be mapped.
func TestMapReturningNothingIsADecodeFailure(t *testing.T) {
	t.Parallel()
	var got *idem.Delivery
	dh := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		got = d
		return idem.Verdict{Ack: true}
	})
	h, err := idemwm.New(dh, &idemwm.Config{Map: func(*message.Message) (*idem.Message, error) { return nil, nil }})
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(message.NewMessage("evt-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	if got == nil || got.Msg != nil || !errors.Is(got.DecodeErr, idem.ErrInvalidMessage) {
		t.Fatalf("delivery %+v; want no message and a DecodeErr matching idem.ErrInvalidMessage", got)
	}
}
