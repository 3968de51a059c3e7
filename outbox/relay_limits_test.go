package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/outbox"
)

// TestAddLongIDWithoutAggregate: a message without an aggregate ID is its
// own ordering key, "msg:" and its ID. An ID of the maximum 255 bytes is
// valid, so Add must store it and a relay publish it on every store.
// (MySQL's ordering_key column holds 255 bytes: Add failed with "Data
// too long" for IDs of 252 bytes and more.)
func TestAddLongIDWithoutAggregate(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			p := open(t)
			ctx := context.Background()
			ids := []string{strings.Repeat("x", idem.MaxIDLen), strings.Repeat("x", idem.MaxIDLen-1) + "y", strings.Repeat("é", 127)}
			for _, id := range ids {
				if err := p.add(ctx, &idem.Message{ID: id, Stream: "s", Payload: []byte("1")}); err != nil {
					t.Fatalf("Add(message with a %d-byte ID, no aggregate): %v", len(id), err)
				}
			}
			pub := &acceptPublisher{}
			r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{})
			if err != nil {
				t.Fatal(err)
			}
			res, err := r.RunOnce(ctx)
			if err != nil || res.Published != len(ids) {
				t.Fatalf("RunOnce: %+v, %v; want %d published", res, err, len(ids))
			}
			// Each is its own key: they go out concurrently, in any order.
			got := pub.published()
			slices.Sort(got)
			slices.Sort(ids)
			if !slices.Equal(got, ids) {
				t.Fatalf("published %q, want %q", got, ids)
			}
		})
	}
}

// TestRelayOwnerIsValidated: the owner is written into every claim. One
// a store cannot hold (a NUL byte, invalid UTF-8, more than 255 bytes)
// failed every claim, for ever, as if the store were failing: NewRelay
// refuses it instead, with idem.ErrInvalidConfig.
func TestRelayOwnerIsValidated(t *testing.T) {
	p := sqliteProducer(t)
	for _, owner := range []string{"relay\x00one", "relay-\xff", strings.Repeat("o", idem.MaxIDLen+1)} {
		if _, err := outbox.NewRelay(p.drv, &acceptPublisher{}, &outbox.RelayConfig{Owner: owner}); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("NewRelay(owner %q) = %v; want ErrInvalidConfig", owner, err)
		}
	}
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			p := open(t)
			ctx := context.Background()
			if err := p.add(ctx, &idem.Message{ID: "m-1", Stream: "s", Payload: []byte("1")}); err != nil {
				t.Fatal(err)
			}
			owner := strings.Repeat("é", idem.MaxIDLen/2) // 254 bytes: the longest valid
			r, err := outbox.NewRelay(p.drv, &acceptPublisher{}, &outbox.RelayConfig{Owner: owner, ClaimTTL: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			if res, err := r.RunOnce(ctx); err != nil || res.Published != 1 {
				t.Fatalf("RunOnce with a %d-byte owner: %+v, %v", len(owner), res, err)
			}
		})
	}
}
