package redisstore_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
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

// indexReads records the size of every reply to a read of the dead
// letters' ID index.
type indexReads struct {
	mu    sync.Mutex
	sizes []int
}

func (h *indexReads) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *indexReads) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *indexReads) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if c, ok := cmd.(*redis.StringSliceCmd); ok && strings.EqualFold(cmd.Name(), "zrangebyscore") {
			h.mu.Lock()
			h.sizes = append(h.sizes, len(c.Val()))
			h.mu.Unlock()
		}
		return err
	}
}

// TestDeadLetterListReadsTheIndexByPages: a page of the console (a Limit)
// over many dead letters read the whole ID index, every ID of every dead
// letter ever kept, for each page. The index is now read a chunk at a
// time, and the listing across chunks is still whole and in order.
func TestDeadLetterListReadsTheIndexByPages(t *testing.T) {
	ctx := context.Background()
	s, c, _ := openStore(t, nil)
	dl := s.Driver.(driver.DeadLetterStore)
	const n = 1000
	for i := range n {
		if _, err := dl.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: fmt.Sprintf("m-%04d", i), Raw: []byte("x"),
			Source: "test", Error: "bad", Class: "permanent", Fingerprint: "fp", Attempts: 1}); err != nil {
			t.Fatal(err)
		}
	}
	h := &indexReads{}
	c.AddHook(h)
	page, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Limit: 10, Summary: true})
	if err != nil || len(page) != 10 || page[0].MessageID != "m-0000" || page[9].MessageID != "m-0009" {
		t.Fatalf("first page: %d dead letters, %v", len(page), err)
	}
	later, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{AfterID: page[9].ID, Limit: 10, Summary: true})
	if err != nil || len(later) != 10 || later[0].MessageID != "m-0010" {
		t.Fatalf("second page: %d dead letters, %v", len(later), err)
	}
	h.mu.Lock()
	for _, size := range h.sizes {
		if size > 256 {
			t.Errorf("a page of 10 read %d IDs of the index at once", size)
		}
	}
	h.mu.Unlock()
	all, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Summary: true})
	if err != nil || len(all) != n {
		t.Fatalf("all: %d dead letters, %v; want %d", len(all), err, n)
	}
	for i, d := range all {
		if want := fmt.Sprintf("m-%04d", i); d.MessageID != want {
			t.Fatalf("dead letter %d is %s, want %s (in ID order, none skipped)", i, d.MessageID, want)
		}
	}
	// A handler's filter past many others' dead letters still finds its
	// own, across chunks.
	if _, err := dl.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "emails", MessageID: "e-1", Raw: []byte("x"),
		Source: "test", Error: "bad", Class: "permanent", Fingerprint: "fp", Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	if got, err := dl.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "emails", Limit: 1}); err != nil || len(got) != 1 || got[0].MessageID != "e-1" {
		t.Fatalf("emails: %+v, %v", got, err)
	}
}
