package watermill_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemhq/idem"
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
