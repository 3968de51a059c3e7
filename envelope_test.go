package idem_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
	"github.com/idemhq/idem/postgres"
	"github.com/idemhq/idem/redisstore"
)

// TestDeadLetterEnvelopeReplaysAnyMessage: a message whose header name and
// value hold a NUL and invalid UTF-8, whose Type holds a NUL, or whose Time
// RFC 3339 cannot carry (a Kafka producer's timestamp after 9999) fails for
// good, and its dead letter keeps an envelope every store accepts; once the
// handler is fixed, Replay runs it with exactly the message that arrived.
// An ordinary message's envelope is still json.Marshal of the message.
func TestDeadLetterEnvelopeReplaysAnyMessage(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) {
		_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
		replayAnyMessage[*sql.Tx](t, drv, drv)
	})
	t.Run("postgres", func(t *testing.T) {
		pool := testenv.PostgresPool(t, 4)
		drv, err := postgres.New(pool, &postgres.Config{Schema: testenv.FreshSchema(t, pool)})
		if err != nil {
			t.Fatal(err)
		}
		if err := drv.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		replayAnyMessage[postgres.Tx](t, drv, drv)
	})
	t.Run("mysql", func(t *testing.T) {
		drv, err := mysql.New(testenv.MySQL(t, testenv.MySQLDatabase(t), 4), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := drv.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		replayAnyMessage[*sql.Tx](t, drv, drv)
	})
	t.Run("redis", func(t *testing.T) {
		client, prefix := testenv.Redis(t)
		drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		if err := drv.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		replayAnyMessage[*redisstore.Tx](t, drv, drv)
	})
}

func replayAnyMessage[TTx any](t *testing.T, drv driver.Driver[TTx], dl driver.DeadLetterStore) {
	ctx := context.Background()
	hostile := &idem.Message{
		ID: "evt-hostile", Stream: "orders", Type: "Funds\x00Credited",
		AggregateID: "base64:acct-1", // a literal that looks encoded
		Payload:     []byte("body\x00\xff"),
		Headers: map[string]string{
			"bin":          "\x00\x01\xff\xfe",
			"latin1":       "caf\xe9\x00",
			"nul\x00name":  "v",
			"\xffname":     "",
			"looks-base64": "base64:AAE=",
			"traceparent":  "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		},
		Time: time.Date(2026, 11, 27, 21, 0, 0, 123456789, time.UTC),
	}
	farTime := &idem.Message{ID: "evt-far-time", Stream: "orders", Type: "FundsCredited", Payload: []byte("x"),
		Time: time.UnixMilli(300_000_000_000_000)} // year 11476
	ordinary := &idem.Message{ID: "evt-ordinary", Stream: "orders", Type: "FundsCredited", Payload: []byte(`{"amount":5}`),
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "note": "base64:literal"},
		Time:    time.Date(2026, 11, 27, 21, 0, 0, 0, time.UTC)}
	sent := []*idem.Message{hostile, farTime, ordinary}

	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		broken = true
		seen   []*idem.Message
	)
	h := &idem.Handler[TTx]{Name: "proj", Apply: func(_ context.Context, _ TTx, m *idem.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if broken {
			return idem.Permanent(errors.New("bug"))
		}
		c := *m
		c.Payload, c.Headers = bytes.Clone(m.Payload), maps.Clone(m.Headers)
		seen = append(seen, &c)
		return nil
	}}
	c, err := idem.NewConsumer(p, h, dl, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range sent {
		// The adapter's message is the handler's: send a copy.
		cp := *m
		cp.Payload, cp.Headers = bytes.Clone(m.Payload), maps.Clone(m.Headers)
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &cp, Raw: cp.Payload, Source: fmt.Sprintf("kafka:orders/0@%d", i), Attempt: 1})
		if !v.Ack || !v.DeadLettered {
			t.Fatalf("%s: verdict %+v, want dead-lettered", m.ID, v)
		}
	}

	dls, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != len(sent) {
		t.Fatalf("%d dead letters, want %d", len(dls), len(sent))
	}
	for _, d := range dls {
		if d.Envelope == nil {
			t.Fatalf("dead letter %d (%s) has no envelope", d.ID, d.MessageID)
		}
		if !utf8.Valid(d.Envelope) || bytes.IndexByte(d.Envelope, 0) >= 0 || bytes.Contains(d.Envelope, []byte(`\u0000`)) || !json.Valid(d.Envelope) {
			t.Fatalf("dead letter %d (%s): envelope %q is not UTF-8 JSON without a NUL", d.ID, d.MessageID, d.Envelope)
		}
		if d.MessageID == ordinary.ID {
			// Version 1, as every ordinary message's envelope was: the
			// message as JSON (compared as values: jsonb reorders keys).
			want, _ := json.Marshal(ordinary)
			var got, exp any
			_ = json.Unmarshal(d.Envelope, &got)
			_ = json.Unmarshal(want, &exp)
			if !jsonEqual(got, exp) {
				t.Fatalf("ordinary message's envelope %s, want %s", d.Envelope, want)
			}
		}
	}

	mu.Lock()
	broken = false
	mu.Unlock()
	if n, err := idem.RequestReplay(ctx, dl, &driver.DeadLetterFilter{Handler: "proj"}, "op"); err != nil || n != len(sent) {
		t.Fatalf("RequestReplay = %d, %v; want %d", n, err, len(sent))
	}
	r, err := c.Replay(ctx)
	if err != nil || r.Replayed != len(sent) || r.Parked != 0 || r.Outcomes[idem.Applied] != len(sent) {
		t.Fatalf("Replay = %+v, %v; want %d replayed and applied, none parked", r, err, len(sent))
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != len(sent) {
		t.Fatalf("handler saw %d messages, want %d", len(seen), len(sent))
	}
	for _, want := range sent {
		var got *idem.Message
		for _, s := range seen {
			if s.ID == want.ID {
				got = s
			}
		}
		if got == nil {
			t.Fatalf("%s was not replayed", want.ID)
		}
		if d := messageDiff(got, want); d != "" {
			t.Errorf("%s replayed %s", want.ID, d)
		}
	}
}

// messageDiff describes how got differs from want, byte for byte (Time
// as an instant), or returns "".
func messageDiff(got, want *idem.Message) string {
	switch {
	case got.ID != want.ID || got.Stream != want.Stream || got.Type != want.Type || got.AggregateID != want.AggregateID || got.Seq != want.Seq:
		return fmt.Sprintf("ID %q Stream %q Type %q AggregateID %q Seq %d, want %q %q %q %q %d", got.ID, got.Stream, got.Type, got.AggregateID, got.Seq,
			want.ID, want.Stream, want.Type, want.AggregateID, want.Seq)
	case !bytes.Equal(got.Payload, want.Payload):
		return fmt.Sprintf("Payload %q, want %q", got.Payload, want.Payload)
	case !maps.Equal(got.Headers, want.Headers) || (got.Headers == nil) != (want.Headers == nil):
		return fmt.Sprintf("Headers %q, want %q", got.Headers, want.Headers)
	case !got.Time.Equal(want.Time):
		return fmt.Sprintf("Time %v, want %v", got.Time, want.Time)
	}
	return ""
}

// jsonEqual reports whether two decoded JSON values are equal.
func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a) // maps marshal in key order
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// TestReplayParksUnreadableEnvelope: an envelope Replay cannot read (a
// version newer than this consumer's) runs nothing and is parked again,
// its history saying why.
func TestReplayParksUnreadableEnvelope(t *testing.T) {
	ctx := context.Background()
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	ran := false
	h := &idem.Handler[*sql.Tx]{Name: "proj", Apply: func(context.Context, *sql.Tx, *idem.Message) error { ran = true; return nil }}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	m := &idem.Message{ID: "evt-1", Payload: []byte("x")}
	id, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "proj", MessageID: m.ID, PayloadHash: m.PayloadHash(),
		Envelope: []byte(`{"EnvelopeVersion":3,"ID":"evt-1","Payload":"eA=="}`), Raw: m.Payload, Error: "bug", Class: idem.DeadLetterPermanent, Fingerprint: "fp", Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.RequestReplay(ctx, drv, &driver.DeadLetterFilter{Handler: "proj"}, "op"); err != nil {
		t.Fatal(err)
	}
	if r, err := c.Replay(ctx); err != nil || r.Replayed != 0 || r.Parked != 1 || ran {
		t.Fatalf("Replay = %+v, %v (handler ran: %v); want it parked, not run", r, err, ran)
	}
	hist, err := drv.DeadLetterHistory(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if last := hist[len(hist)-1]; last.State != driver.DeadLetterParked || !strings.HasPrefix(last.Outcome, "envelope not readable: envelope version 3") {
		t.Fatalf("last history entry %+v, want parked: envelope not readable", last)
	}
}
