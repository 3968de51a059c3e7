package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

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

// hostileErrPublisher refuses every publish with an error text no store
// column takes as it is: invalid UTF-8, a NUL byte, and 70,000 bytes (a
// MySQL BLOB holds 65,535).
type hostileErrPublisher struct{}

func (hostileErrPublisher) Publish(context.Context, []*idem.Message) error {
	return errors.New("refused: \xff\xfe\x00 " + strings.Repeat("x", 70_000))
}

// TestPublishErrorTextIsStorable: whatever text a Publisher's error has,
// the relay records the failure on the row (attempt, last error) and holds
// its key. Before, a text with invalid UTF-8 or a NUL (Postgres) or over
// 64 KiB (MySQL) failed the write: the row showed no failure, its key was
// never held, and every cycle claimed it first again while the whole relay
// backed off as if its store had failed.
func TestPublishErrorTextIsStorable(t *testing.T) {
	for name, mk := range producers() {
		t.Run(name, func(t *testing.T) {
			p := mk(t)
			ctx := context.Background()
			if err := p.add(ctx, &idem.Message{ID: "m-1", Stream: "credits.ledger", AggregateID: "acct-1", Seq: 1, Payload: []byte("1")}); err != nil {
				t.Fatal(err)
			}
			r, err := outbox.NewRelay(p.drv, hostileErrPublisher{}, &outbox.RelayConfig{Backoff: idem.Backoff{Base: time.Minute, Max: time.Minute}})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.RunOnce(ctx); err == nil {
				t.Fatal("a refused publish returned no error")
			}
			s := outboxStats(t, p)
			if s.Failing != 1 || s.LastError == "" {
				t.Fatalf("stats %+v: the failure was not recorded on the row", s)
			}
			if !utf8.ValidString(s.LastError) || strings.Contains(s.LastError, "\x00") || len(s.LastError) > 4096 {
				t.Errorf("last error of %d bytes is not storable text: %q…", len(s.LastError), s.LastError[:min(len(s.LastError), 80)])
			}
			if !strings.Contains(s.LastError, "refused:") {
				t.Errorf("last error %q… lost the cause", s.LastError[:min(len(s.LastError), 80)])
			}
			if res, err := r.RunOnce(ctx); err != nil || res.Claimed != 0 {
				t.Errorf("next cycle: %+v, %v; want nothing claimed, the key held", res, err)
			}
		})
	}
}

// panickyPublisher panics on a message of type "boom", as a Publisher
// with a bug a row meets, and takes the others.
type panickyPublisher struct{ acceptPublisher }

func (p *panickyPublisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	for _, m := range msgs {
		if m.Type == "boom" {
			var parts []string
			_ = parts[len(m.Payload)]
		}
	}
	return p.acceptPublisher.Publish(ctx, msgs)
}

// TestPublisherPanicFailsTheKey: a Publisher that panics on a row fails
// that row's key, as a refused publish does: recorded on the row, held
// for its backoff, and the other keys published. Before, the panic ended
// the process, and every restart claimed the same row first again.
func TestPublisherPanicFailsTheKey(t *testing.T) {
	p := sqliteProducer(t)
	ctx := context.Background()
	if err := p.add(ctx,
		&idem.Message{ID: "m-1", Stream: "credits.ledger", AggregateID: "acct-1", Seq: 1, Type: "boom", Payload: []byte("1")},
		&idem.Message{ID: "m-2", Stream: "credits.ledger", AggregateID: "acct-2", Seq: 1, Payload: []byte("1")},
	); err != nil {
		t.Fatal(err)
	}
	pub := &panickyPublisher{}
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Backoff: idem.Backoff{Base: time.Minute, Max: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.RunOnce(ctx)
	if err == nil || !strings.Contains(err.Error(), "panicked") {
		t.Fatalf("cycle error %v, want the publisher's panic", err)
	}
	if res.Published != 1 || !slices.Equal(pub.published(), []string{"m-2"}) {
		t.Fatalf("published %+v (%q), want m-2 only", res, pub.published())
	}
	if s := outboxStats(t, p); s.Failing != 1 || !strings.Contains(s.LastError, "panicked") {
		t.Fatalf("stats %+v: the panic was not recorded on the row", s)
	}
	if res, err := r.RunOnce(ctx); err != nil || res.Claimed != 0 {
		t.Errorf("next cycle: %+v, %v; want nothing claimed, the key held", res, err)
	}
}
