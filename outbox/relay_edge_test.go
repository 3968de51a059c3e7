package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// acceptPublisher takes everything; it records what it was given, and can
// be slowed down for one ordering key.
type acceptPublisher struct {
	mu      sync.Mutex
	got     []string
	calls   atomic.Int64
	slowKey string
	slowFor time.Duration
}

func (p *acceptPublisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	p.calls.Add(1)
	if err := ctx.Err(); err != nil { // as a real broker client would
		return err
	}
	if p.slowKey != "" && msgs[0].AggregateID == p.slowKey {
		time.Sleep(p.slowFor)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.got = append(p.got, m.ID)
	}
	return nil
}

func (p *acceptPublisher) published() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.got...)
}

// TestRelaysShareASmallPool: each relay LISTENs on Postgres on a
// connection of its own, beside the driver's pool: two relays on a pool of
// two connections still claim and publish (when the listeners held pooled
// connections, neither relay could ever claim).
func TestRelaysShareASmallPool(t *testing.T) {
	admin := testenv.PostgresPool(t, 4)
	schema := testenv.FreshSchema(t, admin)
	adminDrv, err := postgres.New(admin, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := adminDrv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(adminDrv)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Add(ctx, tx, &idem.Message{ID: "m-1", Stream: "s", AggregateID: "a", Seq: 1, Payload: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	small := testenv.PostgresPool(t, 2)
	drv, err := postgres.New(small, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	pub := &acceptPublisher{}
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i := range 2 {
		r, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{Owner: fmt.Sprintf("r%d", i), PollInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = r.Run(rctx) }()
	}
	defer func() { stop(); wg.Wait() }()
	deadline := time.Now().Add(5 * time.Second)
	for len(pub.published()) == 0 {
		if time.Now().After(deadline) {
			st := small.Stat()
			t.Fatalf("row not published after 5 s: two relays on a 2-connection pool (acquired %d of %d, all by LISTEN)", st.AcquiredConns(), st.MaxConns())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSQLiteClaimsMoreKeysThanBoundVariables: a claim of more than 32,766
// keys (SQLite's bound on variables) publishes them all; the rows of the
// claimed keys were read with one ? per key, which failed every cycle.
func TestSQLiteClaimsMoreKeysThanBoundVariables(t *testing.T) {
	p := sqliteProducer(t)
	ctx := context.Background()
	const n = 33_000
	msgs := make([]*idem.Message, n)
	for i := range msgs { // no aggregate: each message is its own key
		msgs[i] = &idem.Message{ID: fmt.Sprintf("m-%05d", i), Stream: "s", Payload: []byte("1")}
	}
	if err := p.add(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	pub := &acceptPublisher{}
	// A long claim: under -race on a busy machine claiming and reading
	// 33,000 keys has taken over 30 s, and a key whose turn comes after
	// half the claim is left for the next cycle (TestKeyLeftLateIsTakenUpSoon),
	// which is not what this test is about.
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "r", BatchSize: 40_000, ClaimTTL: 30 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.RunOnce(ctx)
	if err != nil || res.Published != n {
		t.Fatalf("cycle with BatchSize 40,000 over %d keys: %+v, %v; want all published", n, res, err)
	}
}

// slowClaim is a relay store whose claims take perRow a row more, as on a
// slow disk; it records the size of each, in rows and payload bytes.
type slowClaim struct {
	driver.OutboxRelayStore
	perRow time.Duration
	mu     sync.Mutex
	sizes  []int
	bytes  []int
}

func (s *slowClaim) OutboxClaim(ctx context.Context, owner string, limit, maxBytes int, ttl time.Duration) ([]driver.OutboxRow, bool, error) {
	rows, cut, err := s.OutboxRelayStore.OutboxClaim(ctx, owner, limit, maxBytes, ttl)
	time.Sleep(time.Duration(len(rows)) * s.perRow)
	n := 0
	for _, r := range rows {
		n += len(r.Payload)
	}
	s.mu.Lock()
	s.sizes = append(s.sizes, len(rows))
	s.bytes = append(s.bytes, n)
	s.mu.Unlock()
	return rows, cut, err
}

// TestBatchBytesBoundsEachCycle: rows of 1,000-byte payloads, one of
// 2,400, under a BatchBytes of 2,500 are claimed at most two at a time,
// whatever BatchSize, and every row is published, each key's in order.
// The relay takes a claim the bound cut short for a full one and comes
// back at once, not after PollInterval (an hour here), also when the row
// left out is larger than every row taken. Without a bound a relay held
// BatchSize rows in memory, however large their payloads.
func TestBatchBytesBoundsEachCycle(t *testing.T) {
	t.Parallel()
	p := sqliteProducer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var msgs []*idem.Message
	for seq := int64(1); seq <= 4; seq++ {
		for _, key := range []string{"a", "b", "c"} {
			size := 1000
			if key == "a" && seq == 2 { // after a claim of [a-1, b-1] and one of [c-1]
				size = 2400
			}
			msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("%s-%d", key, seq), Stream: "s", AggregateID: key, Seq: seq, Payload: bytes.Repeat([]byte{'x'}, size)})
		}
	}
	if err := p.add(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	store := &slowClaim{OutboxRelayStore: p.drv.(driver.OutboxRelayStore)}
	pub := &acceptPublisher{}
	r, err := outbox.NewRelay(store, pub, &outbox.RelayConfig{Owner: "r", BatchBytes: 2500, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	rctx, stop := context.WithCancel(ctx)
	go func() { done <- r.Run(rctx) }()
	for len(pub.published()) < len(msgs) && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	<-done
	store.mu.Lock()
	sizes, claimed := slices.Clone(store.sizes), slices.Clone(store.bytes)
	store.mu.Unlock()
	got := pub.published()
	if len(got) != len(msgs) {
		t.Fatalf("published %d rows of %d in 30 s (claims of %v rows)", len(got), len(msgs), sizes)
	}
	for _, n := range claimed {
		if n > 2500 {
			t.Fatalf("a claim of %d payload bytes, over BatchBytes 2,500 (claims of %v bytes)", n, claimed)
		}
	}
	last := map[string]string{}
	for _, id := range got {
		key := id[:1]
		if id <= last[key] {
			t.Fatalf("key %s published out of order: %v", key, got)
		}
		last[key] = id
	}
	if _, err := outbox.NewRelay(store, pub, &outbox.RelayConfig{BatchBytes: -2}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("BatchBytes -2: %v; want ErrInvalidConfig", err)
	}
}

// TestClaimTooLargeIsHalved: a claim so large that reading it takes more
// than half ClaimTTL leaves every key late, every cycle; the relay halves
// its claim until keys get their turn, and publishes every row, once.
// (Before, it claimed the same rows again and again and published none.)
func TestClaimTooLargeIsHalved(t *testing.T) {
	p := sqliteProducer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 200
	msgs := make([]*idem.Message, n)
	for i := range msgs { // each message its own key
		msgs[i] = &idem.Message{ID: fmt.Sprintf("m-%03d", i), Stream: "s", Payload: []byte("1")}
	}
	if err := p.add(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	store := &slowClaim{OutboxRelayStore: p.drv.(driver.OutboxRelayStore), perRow: 2 * time.Millisecond}
	pub := &acceptPublisher{}
	// 200 rows take 400 ms to claim, past half of 500 ms; 100 rows 200 ms.
	logs := &testenv.Buffer{}
	r, err := outbox.NewRelay(store, pub, &outbox.RelayConfig{Owner: "r", BatchSize: n, ClaimTTL: 500 * time.Millisecond, PollInterval: time.Hour,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	rctx, stop := context.WithCancel(ctx)
	go func() { done <- r.Run(rctx) }()
	for len(pub.published()) < n && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	<-done
	got := pub.published()
	seen := map[string]bool{}
	for _, id := range got {
		seen[id] = true
	}
	store.mu.Lock()
	sizes := slices.Clone(store.sizes)
	store.mu.Unlock()
	if len(seen) != n {
		t.Fatalf("published %d distinct rows of %d (claims of %v)", len(seen), n, sizes)
	}
	if len(sizes) < 2 || sizes[0] != n || slices.Min(sizes[1:]) > n/2 {
		t.Fatalf("claims of %v: want %d first, then at most %d", sizes, n, n/2)
	}
	// The late keys are counted in one short line, not listed.
	out := logs.String()
	if !strings.Contains(out, "claiming fewer rows a cycle") || !strings.Contains(out, "200 of 200 keys") {
		t.Fatalf("logs do not tell of the halved claim and the late keys:\n%s", out)
	}
	for _, line := range strings.Split(out, "\n") {
		if len(line) > 600 {
			t.Fatalf("a log line of %d bytes: %.300s…", len(line), line)
		}
	}
}

// TestKeyLeftLateIsTakenUpSoon: a key whose turn comes after half the
// claim is left unheld for the next cycle, and Run comes back for it at
// once, not after PollInterval (an hour here, as with notifications on).
func TestKeyLeftLateIsTakenUpSoon(t *testing.T) {
	p := sqliteProducer(t)
	ctx := context.Background()
	if err := p.add(ctx,
		&idem.Message{ID: "slow-1", Stream: "s", AggregateID: "slow", Seq: 1, Payload: []byte("1")},
		&idem.Message{ID: "fast-1", Stream: "s", AggregateID: "fast", Seq: 1, Payload: []byte("1")},
	); err != nil {
		t.Fatal(err)
	}
	// The slow key's publish succeeds after 150 ms: past half of the
	// 200 ms claim, so the fast key (one key at a time) is skipped.
	pub := &acceptPublisher{slowKey: "slow", slowFor: 150 * time.Millisecond}
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "r", Concurrency: 1, ClaimTTL: 200 * time.Millisecond, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	defer func() { stop(); <-done }()
	waitFor(t, "the skipped key's row (claimed, not failed) to be published", 3*time.Second, func() bool {
		return outboxStats(t, p).Pending == 0
	})
}

// TestAddValidatesStreamTypeAndHeaders: a Stream, Type or header that is
// not text is an *idem.ValidationError on every store, and nothing is
// added. (SQLite stored a NUL in Stream, to fail at every publish;
// Postgres refused it with a bare driver error; a header's invalid UTF-8
// was silently replaced by json.Marshal.)
func TestAddValidatesStreamTypeAndHeaders(t *testing.T) {
	for name, open := range producers() {
		t.Run(name, func(t *testing.T) {
			p := open(t)
			ctx := context.Background()
			for _, bad := range []*idem.Message{
				{ID: "nul-stream", Stream: "credits\x00ledger"},
				{ID: "utf8-stream", Stream: "credits.\xff"},
				{ID: "nul-type", Stream: "s", Type: "Cred\x00ited"},
				{ID: "no-stream", Stream: ""},
				{ID: "utf8-header", Stream: "s", Headers: map[string]string{"trace": "ab\xffcd"}},
				{ID: "own-header", Stream: "s", Headers: map[string]string{"idem-seq": "7"}},
			} {
				err := p.add(ctx, bad)
				var ve *idem.ValidationError
				if !errors.Is(err, idem.ErrInvalidMessage) || !errors.As(err, &ve) {
					t.Errorf("Add(%s: stream %q, type %q) = %v; want an *idem.ValidationError (ErrInvalidMessage)", bad.ID, bad.Stream, bad.Type, err)
				}
			}
			if st := outboxStats(t, p); st.Pending != 0 {
				t.Errorf("%d rows added; want none", st.Pending)
			}
		})
	}
}

// TestAddNextLengthLimit: stream and aggregate ID together may take up to
// 230 bytes with a stream of 100 bytes or more, as documented; one more
// would make the ID "<n>:<stream>-<aggregate>-<19 digits>" 256 bytes long.
func TestAddNextLengthLimit(t *testing.T) {
	p := sqliteProducer(t)
	ctx := context.Background()
	stream, agg := strings.Repeat("s", 200), strings.Repeat("a", 30) // 230 bytes
	if _, err := p.credit(ctx, stream, agg, 1, false); err != nil {
		t.Fatalf("AddNext with stream+aggregate of 230 bytes (documented maximum): %v", err)
	}
	if _, err := p.credit(ctx, stream, agg+"a", 1, false); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("AddNext with stream+aggregate of 231 bytes and a 3-digit stream length: %v, want ErrInvalidMessage", err)
	}
	if n := len(outbox.MessageID(stream, agg, math.MaxInt64)); n != idem.MaxIDLen {
		t.Fatalf("longest ID %d bytes, want %d", n, idem.MaxIDLen)
	}
}

// TestMessageIDsDoNotCollide: two streams and aggregates never share an
// ID; without the stream's length, "orders"/"eu-7" and "orders-eu"/"7"
// both gave "orders-eu-7-1", and a consumer of both (or one JetStream
// stream's duplicate window) took the second event for the first.
func TestMessageIDsDoNotCollide(t *testing.T) {
	if a, b := outbox.MessageID("orders", "eu-7", 1), outbox.MessageID("orders-eu", "7", 1); a == b {
		t.Fatalf("MessageID(orders, eu-7, 1) = MessageID(orders-eu, 7, 1) = %q", a)
	}
	if got := outbox.MessageID("credits", "acct-1", 12); got != "7:credits-acct-1-12" {
		t.Fatalf("MessageID = %q, want 7:credits-acct-1-12", got)
	}
	// The Postgres driver builds the ID in its statement: the same one.
	for name, open := range producers() {
		p := open(t)
		m, err := p.credit(context.Background(), "orders-eu", "7", 1, false)
		if err != nil || m.ID != outbox.MessageID("orders-eu", "7", 1) {
			t.Fatalf("%s: AddNext gave %v, %v; want %q", name, m, err, outbox.MessageID("orders-eu", "7", 1))
		}
		rows, _, err := p.drv.(driver.OutboxRelayStore).OutboxClaim(context.Background(), "check", 10, 0, time.Minute)
		if err != nil || len(rows) != 1 || rows[0].MessageID != m.ID {
			t.Fatalf("%s: stored rows %+v, %v; want one with ID %q", name, rows, err, m.ID)
		}
	}
}

// TestUnreadableRowLetsEarlierRowsOut: a row that cannot be turned into a
// message (headers that do not decode, written other than by Add) holds
// its key from that row on: the rows before it are published, and the
// failure is recorded on it, not on the key's first row.
func TestUnreadableRowLetsEarlierRowsOut(t *testing.T) {
	p := postgresProducer(t)
	ctx := context.Background()
	if err := p.add(ctx, &idem.Message{ID: "good-1", Stream: "s", AggregateID: "k", Seq: 1, Payload: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	admin := testenv.PostgresPool(t, 2)
	if _, err := admin.Exec(ctx, `INSERT INTO `+p.schema+`.idem_outbox (destination, message_id, ordering_key, aggregate_id, seq, headers, payload, payload_hash)
VALUES ('s', 'bad-2', 'k', 'k', 2, '{"n": 1}', 'x', 'h')`); err != nil {
		t.Fatal(err)
	}
	pub := &acceptPublisher{}
	r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "r", Backoff: idem.Backoff{Base: time.Minute, Max: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.RunOnce(ctx)
	if got := pub.published(); len(got) != 1 || got[0] != "good-1" || res.Published != 1 || res.Failed != 1 || err == nil {
		t.Fatalf("cycle %+v, %v; published %v: want good-1 (before the unreadable row) published, bad-2 failed", res, err, got)
	}
	var attempts int
	if err := admin.QueryRow(ctx, `SELECT attempts FROM `+p.schema+`.idem_outbox WHERE message_id = 'bad-2'`).Scan(&attempts); err != nil || attempts != 1 {
		t.Fatalf("bad-2 attempts %d, %v; want the failure recorded on it", attempts, err)
	}
	if st := outboxStats(t, p); st.Pending != 1 || st.Failing != 1 || !strings.Contains(st.LastError, "headers") {
		t.Fatalf("stats %+v; want bad-2 alone pending, failing on its headers", st)
	}
}

// TestHugeClaimTTL: a ClaimTTL of a century publishes (nine tenths of it,
// the publishes' deadline, overflowed into the past), and a negative
// backoff is refused like the other negative settings.
func TestHugeClaimTTL(t *testing.T) {
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "p.db"), nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	db := drv.DB()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Add(ctx, tx, &idem.Message{ID: "m-1", Stream: "s", Payload: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	pub := &acceptPublisher{}
	r, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{Owner: "r", ClaimTTL: 100 * 365 * 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.RunOnce(ctx)
	if err != nil || res.Published != 1 {
		t.Fatalf("cycle with a 100-year ClaimTTL: %+v, %v (publisher called %d times); want the row published", res, err, pub.calls.Load())
	}
	for _, b := range []idem.Backoff{{Base: -time.Second}, {Max: -time.Second}} {
		if _, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{Backoff: b}); !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("NewRelay with Backoff %+v: %v, want ErrInvalidConfig", b, err)
		}
	}
}

// TestAddNextRefusedAllocatesNothing: AddNext refuses an invalid message
// (here a Type with a NUL byte) before it allocates a sequence, on every
// store. Before, SQLite allocated first, so a transaction that went on
// after the refusal committed a sequence no event had, and the next
// event's sequence left a gap for the consumers' ordering guard.
func TestAddNextRefusedAllocatesNothing(t *testing.T) {
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "producer.db"), nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := ob.AddNext(ctx, tx, "orders", "o-1", "Placed\x00", []byte("x")); !errors.Is(err, idem.ErrInvalidMessage) {
		t.Fatalf("AddNext of an invalid Type: %v, want ErrInvalidMessage", err)
	}
	m, err := ob.AddNext(ctx, tx, "orders", "o-1", "Placed", []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if m.Seq != 1 {
		t.Fatalf("first event of the aggregate got sequence %d, want 1: the refused call allocated one", m.Seq)
	}
}
