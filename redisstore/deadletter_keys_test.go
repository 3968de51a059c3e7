package redisstore_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// TestDeadLetterKeyWithoutPayloadHash: a dead letter written before dead
// letters were keyed by payload hash (its key "handler|message ID") is
// found again by the same payload, and takes the new key; another payload
// of the same message ID is a dead letter of its own.
func TestDeadLetterKeyWithoutPayloadHash(t *testing.T) {
	ctx := context.Background()
	s, c, prefix := openStore(t, nil)
	dl := s.Driver.(driver.DeadLetterStore)
	pipe := c.TxPipeline()
	pipe.Set(ctx, prefix+"dl:seq", 1, 0)
	pipe.ZAdd(ctx, prefix+"dl:ids", redis.Z{Score: 1, Member: "1"})
	pipe.HSet(ctx, prefix+"dl:keys", "balances|junk-1", 1)
	pipe.HSet(ctx, prefix+"dl:1", "handler", "balances", "message_id", "junk-1", "raw", "not a credit", "source", "test",
		"error", "bad", "class", "permanent", "fingerprint", "fp", "attempts", 1, "first", 1, "last", 1, "state", "discarded")
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	put := func(m *idem.Message, errText string) int64 {
		t.Helper()
		id, err := dl.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: m.ID, PayloadHash: m.PayloadHash(), Raw: m.Payload,
			Source: "test", Error: errText, Class: "permanent", Fingerprint: "fp", Attempts: 2})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	same := &idem.Message{ID: "junk-1", Payload: []byte("not a credit")}
	other := &idem.Message{ID: "junk-1", Payload: []byte("another payload")}
	if id := put(other, "bad"); id != 2 {
		t.Fatalf("another payload: dead letter %d, want a new one, 2", id)
	}
	if id := put(same, "bad again"); id != 1 {
		t.Fatalf("the same payload: dead letter %d, want 1", id)
	}
	if id := put(same, "bad again"); id != 1 {
		t.Fatalf("the same payload, by its new key: dead letter %d, want 1", id)
	}
	got, err := dl.DeadLetterList(ctx, nil)
	if err != nil || len(got) != 2 || string(got[0].PayloadHash) != string(same.PayloadHash()) || got[0].Error != "bad again" ||
		string(got[1].Raw) != string(other.Payload) {
		t.Fatalf("dead letters %+v, %v; want 1 with its hash filled in and 2 with the other payload", got, err)
	}
	if n, err := c.HExists(ctx, prefix+"dl:keys", "balances|junk-1").Result(); err != nil || n {
		t.Fatalf("the key without the hash is still there (%v, %v)", n, err)
	}
}
