package watermill_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemhq/idem"
	idemwm "github.com/idemhq/idem/watermill"
)

// With the documented chain (PoisonQueue filtered by Poisonable, Retry
// inside it, the Handler under ErrorAtOnce), a router closed while Retry
// waits its backoff makes Retry return the context's error instead of
// the Handler's RetryError. That is the delivery stopping, not a poison
// message: it must be Nacked, never published to the poison topic and
// acknowledged there, out of idem's hands.
func TestRouterClosedDuringRetryBackoffIsNotPoison(t *testing.T) {
	t.Parallel()
	e := newLiteEnv(t, idem.ConsumerConfig{}, nil)
	rec := &attempts{next: e.c}
	h, err := idemwm.New(rec, &idemwm.Config{Retry: idemwm.ErrorAtOnce})
	if err != nil {
		t.Fatal(err)
	}
	ch := gochannel.NewGoChannel(gochannel.Config{}, wmLogger(t))
	t.Cleanup(func() { ch.Close() })
	poisonCh := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, wmLogger(t))
	t.Cleanup(func() { poisonCh.Close() })
	pq, err := idemwm.PoisonQueue(poisonCh, "poison")
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 10, InitialInterval: time.Minute, ShouldRetry: idemwm.ShouldRetry}
	stop := runRouter(t, ch, "in", h.Handle, pq, retry.Middleware)

	e.fail.Store(true)
	if err := ch.Publish("in", message.NewMessage("busy", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the first attempt", func() bool { return len(rec.of("busy")) == 1 })
	stop() // Retry is waiting its minute: the message's context ends.

	sub, err := poisonCh.Subscribe(t.Context(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-sub:
		t.Fatalf("message %q reached the poison topic (reason %q) and was acknowledged: the router was only stopping",
			m.UUID, m.Metadata.Get(middleware.ReasonForPoisonedKey))
	case <-time.After(200 * time.Millisecond):
	}
	if n := e.seen(t); n != 0 {
		t.Fatalf("%d rows applied, want 0", n)
	}

	for _, err := range []error{context.Canceled, context.DeadlineExceeded, errors.Join(errors.New("x"), context.Canceled)} {
		if idemwm.Poisonable(err) {
			t.Fatalf("Poisonable(%v) = true: a delivery whose context ended is not poison", err)
		}
	}
}
