package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/postgres"
)

// chainStore is the order-sensitive effect of the stress tests below: each
// aggregate's state is the list of the sequences applied to it, in the
// order they were applied.
type chainStore[TTx any] struct {
	drv    driver.Driver[TTx]
	dl     driver.DeadLetterStore
	append func(ctx context.Context, tx TTx, agg string, seq int64) error
	// row is an in-row handler's guarded write: the row's last_seq
	// column is the aggregate's last applied sequence.
	row    func(ctx context.Context, tx TTx, g *idem.RowGuard) (idem.RowWrite, error)
	states func(ctx context.Context) (map[string]string, error)
}

// runValue is what a guarded write appends for g's messages.
func runValue(g *idem.RowGuard) string {
	var b strings.Builder
	for _, m := range g.Msgs {
		b.WriteString("," + strconv.FormatInt(m.Seq, 10))
	}
	return b.String()
}

func sqliteChains(t *testing.T) *chainStore[*sql.Tx] {
	drv := freshSQLite(t)
	db := drv.DB()
	if _, err := db.Exec(`CREATE TABLE chains (agg TEXT PRIMARY KEY, value TEXT NOT NULL, last_seq INTEGER NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	return &chainStore[*sql.Tx]{drv: drv, dl: drv,
		append: func(ctx context.Context, tx *sql.Tx, agg string, seq int64) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO chains (agg, value) VALUES (?, ?) ON CONFLICT (agg) DO UPDATE SET value = value || excluded.value`,
				agg, ","+strconv.FormatInt(seq, 10))
			return err
		},
		// The transaction holds SQLite's write lock: a plain read is
		// locked enough.
		row: func(ctx context.Context, tx *sql.Tx, g *idem.RowGuard) (idem.RowWrite, error) {
			var w idem.RowWrite
			err := tx.QueryRowContext(ctx, `SELECT last_seq FROM chains WHERE agg = ?`, g.AggregateID).Scan(&w.Prev)
			if err != nil && !errors.Is(err, sql.ErrNoRows) {
				return w, err
			}
			if !g.Admits(w.Prev) {
				return w, nil
			}
			_, err = tx.ExecContext(ctx, `INSERT INTO chains VALUES (?, ?, ?) ON CONFLICT (agg) DO UPDATE SET value = value || excluded.value, last_seq = excluded.last_seq`,
				g.AggregateID, runValue(g), g.To())
			w.Advanced = err == nil
			return w, err
		},
		states: func(ctx context.Context) (map[string]string, error) {
			return chainStates(db.QueryContext(ctx, `SELECT agg, value FROM chains`))
		},
	}
}

func postgresChains(t *testing.T) *chainStore[postgres.Tx] {
	pool := testenv.PostgresPool(t, 12)
	schema := testenv.FreshSchema(t, pool)
	drv, err := postgres.New(pool, &postgres.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	table := pgx.Identifier{schema, "chains"}.Sanitize()
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+table+` (agg text PRIMARY KEY, value text NOT NULL, last_seq bigint NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	return &chainStore[postgres.Tx]{drv: drv, dl: drv,
		append: func(ctx context.Context, tx postgres.Tx, agg string, seq int64) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+table+` AS c (agg, value) VALUES ($1, $2) ON CONFLICT (agg) DO UPDATE SET value = c.value || excluded.value`,
				agg, ","+strconv.FormatInt(seq, 10))
			return err
		},
		// A locked read, then a write that only a missing row can lose
		// (to a concurrent creator: not advanced, and idem retries).
		row: func(ctx context.Context, tx postgres.Tx, g *idem.RowGuard) (idem.RowWrite, error) {
			var w idem.RowWrite
			err := tx.QueryRow(ctx, `SELECT last_seq FROM `+table+` WHERE agg = $1 FOR UPDATE`, g.AggregateID).Scan(&w.Prev)
			missing := errors.Is(err, pgx.ErrNoRows)
			if err != nil && !missing {
				return w, err
			}
			if !g.Admits(w.Prev) {
				return w, nil
			}
			q := `UPDATE ` + table + ` SET value = value || $2, last_seq = $3 WHERE agg = $1`
			if missing {
				q = `INSERT INTO ` + table + ` VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`
			}
			tag, err := tx.Exec(ctx, q, g.AggregateID, runValue(g), g.To())
			w.Advanced = err == nil && tag.RowsAffected() == 1
			return w, err
		},
		states: func(ctx context.Context) (map[string]string, error) {
			rows, err := pool.Query(ctx, `SELECT agg, value FROM `+table)
			if err != nil {
				return nil, err
			}
			m := map[string]string{}
			var a, v string
			_, err = pgx.ForEachRow(rows, []any{&a, &v}, func() error { m[a] = v; return nil })
			return m, err
		},
	}
}

func chainStates(rows *sql.Rows, err error) (map[string]string, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]string{}
	for rows.Next() {
		var a, v string
		if err := rows.Scan(&a, &v); err != nil {
			return nil, err
		}
		m[a] = v
	}
	return m, rows.Err()
}

// wantChains is the state of aggs aggregates with sequences 1..per each
// applied once, in order.
func wantChains(aggs, per int) map[string]string {
	var b strings.Builder
	for q := 1; q <= per; q++ {
		b.WriteString("," + strconv.Itoa(q))
	}
	want := map[string]string{}
	for a := range aggs {
		want[fmt.Sprintf("agg-%02d", a)] = b.String()
	}
	return want
}

// pending is one message on the simulated broker.
type pending struct {
	msg       *idem.Message
	attempt   int
	notBefore time.Time
}

// brokerRun delivers msgs to c in batches of 1 to 16 from workers
// goroutines, out of order, as a broker that redelivers and reorders
// would: a delivery to be retried goes back to the queue, due after its
// RetryAfter (capped at 20 ms), at a random place. It returns when every
// delivery was acknowledged, or fails t after the deadline.
func brokerRun[TTx any](t *testing.T, c *idem.Consumer[TTx], msgs []*idem.Message, workers int, seed uint64) (applied, deadLettered int) {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, seed+1))
	var (
		mu    sync.Mutex
		queue = make([]pending, len(msgs))
		busy  int
	)
	for i, m := range msgs {
		queue[i] = pending{msg: m, attempt: 1}
	}
	deadline := time.Now().Add(2 * time.Minute)
	take := func() ([]pending, bool) {
		mu.Lock()
		defer mu.Unlock()
		if len(queue) == 0 {
			return nil, busy > 0
		}
		now := time.Now()
		n := 1 + r.IntN(16)
		var b []pending
		for i := 0; i < len(queue) && len(b) < n; {
			if queue[i].notBefore.After(now) {
				i++
				continue
			}
			b = append(b, queue[i])
			queue = slices.Delete(queue, i, i+1)
		}
		if len(b) > 0 {
			busy++
		}
		return b, true
	}
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				b, more := take()
				if !more {
					return
				}
				if len(b) == 0 {
					time.Sleep(time.Millisecond)
					continue
				}
				ds := make([]*idem.Delivery, len(b))
				for i, p := range b {
					ds[i] = &idem.Delivery{Msg: p.msg, Attempt: p.attempt, Source: "test"}
				}
				vs := c.HandleDeliveries(context.Background(), ds)
				mu.Lock()
				busy--
				for i, v := range vs {
					switch {
					case v.DeadLettered:
						deadLettered++
					case v.Ack:
						if v.Outcome == idem.Applied {
							applied++
						}
					default:
						p := b[i]
						p.attempt++
						p.notBefore = time.Now().Add(min(v.RetryAfter, 20*time.Millisecond))
						at := r.IntN(len(queue) + 1)
						queue = slices.Insert(queue, at, p)
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if len(queue) > 0 || busy > 0 {
		t.Fatalf("%d deliveries never acknowledged by the deadline, first %s (attempt %d)", len(queue), queue[0].msg.ID, queue[0].attempt)
	}
	return applied, deadLettered
}

// shuffledStream is every event of aggs aggregates of per sequences, a
// fifth of them twice, in random order.
func shuffledStream(aggs, per int, seed uint64) []*idem.Message {
	r := rand.New(rand.NewPCG(seed, seed*3+1))
	var msgs []*idem.Message
	for a := range aggs {
		for q := 1; q <= per; q++ {
			agg := fmt.Sprintf("agg-%02d", a)
			m := &idem.Message{ID: fmt.Sprintf("%s-%d", agg, q), AggregateID: agg, Seq: int64(q), Payload: []byte(agg + ":" + strconv.Itoa(q))}
			msgs = append(msgs, m)
			if r.IntN(5) == 0 {
				cp := *m
				msgs = append(msgs, &cp)
			}
		}
	}
	r.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	return msgs
}

// consumerShuffled runs a shuffled stream with duplicates through a
// Consumer's batches from several workers at once, under GapWait, with a
// handler that fails now and then (so batches fall back to deciding their
// deliveries alone): every event applies exactly once and in sequence
// order, nothing is dead-lettered, and the final state is the in-order
// application of the unique events.
func consumerShuffled[TTx any](t *testing.T, s *chainStore[TTx], mode string) {
	const aggs, per = 12, 25
	ctx := context.Background()
	p, err := idem.NewProcessor(s.drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := &idem.Handler[TTx]{Name: "chains", Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Minute, VersionOnly: mode == "version-only"},
		Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
			if calls.Add(1)%17 == 0 {
				return errors.New("ledger busy")
			}
			return s.append(ctx, tx, m.AggregateID, m.Seq)
		}}
	if mode == "in-row" {
		h.Apply = nil
		h.ApplyInRow = func(ctx context.Context, tx TTx, g *idem.RowGuard) (idem.RowWrite, error) {
			if calls.Add(1)%17 == 0 {
				return idem.RowWrite{}, errors.New("ledger busy")
			}
			return s.row(ctx, tx, g)
		}
	}
	c, err := idem.NewConsumer(p, h, s.dl, &idem.ConsumerConfig{Logger: testenv.Logger(t),
		Backoff: idem.Backoff{Base: time.Millisecond, Max: 5 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	applied, deadLettered := brokerRun(t, c, shuffledStream(aggs, per, 11), 4, 5)
	if deadLettered != 0 {
		dls, _ := s.dl.DeadLetterList(ctx, &driver.DeadLetterFilter{})
		t.Fatalf("%d dead letters, want none; first: %+v", deadLettered, dls[0])
	}
	if applied != aggs*per {
		t.Fatalf("%d applied verdicts for %d unique events", applied, aggs*per)
	}
	got, err := s.states(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := wantChains(aggs, per)
	for a, w := range want {
		if got[a] != w {
			t.Fatalf("aggregate %s is %q, want %q", a, got[a], w)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("%d aggregates, want %d", len(got), len(want))
	}
}

// TestConsumerShuffledStreamUnderGapWait runs consumerShuffled on SQLite
// and PostgreSQL, with markers, in version-only mode and with the in-row
// guard.
func TestConsumerShuffledStreamUnderGapWait(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"markers", "version-only", "in-row"} {
		t.Run("sqlite/"+mode, func(t *testing.T) { consumerShuffled(t, sqliteChains(t), mode) })
		t.Run("postgres/"+mode, func(t *testing.T) { consumerShuffled(t, postgresChains(t), mode) })
	}
}

// batchEquivalence checks ProcessBatch against one message at a time:
// store a processes random batches (redeliveries, the same ID with another
// payload, two IDs claiming one sequence, gaps, unsequenced messages),
// store b processes each batch's messages alone, each aggregate's in
// sequence order in the places the batch gave it, as the batch documents
// it applies them. A message the batch leaves undecided is decided alone
// after it, as a Consumer does. Every message must end with the same
// outcome in both (a gap being OutcomeNone in both), and both stores
// with the same state.
func batchEquivalence[TTx any](t *testing.T, a, b *chainStore[TTx], o idem.Ordering, inRow bool, seed uint64) {
	ctx := context.Background()
	procs := make([]*idem.Processor[TTx], 2)
	hs := make([]*idem.Handler[TTx], 2)
	for k, s := range []*chainStore[TTx]{a, b} {
		p, err := idem.NewProcessor(s.drv, nil)
		if err != nil {
			t.Fatal(err)
		}
		procs[k] = p
		ord := o
		hs[k] = &idem.Handler[TTx]{Name: "chains", Ordering: &ord, Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
			seq := m.Seq
			if seq == 0 {
				seq = -1
			}
			return s.append(ctx, tx, m.AggregateID, seq)
		}}
		if inRow {
			hs[k].Apply, hs[k].ApplyInRow = nil, s.row
		}
	}
	sequencedOnly := o.VersionOnly || inRow
	r := rand.New(rand.NewPCG(seed, 99))
	gen := func() *idem.Message {
		agg := []string{"x", "y", "z"}[r.IntN(3)]
		seq := int64(1 + r.IntN(8))
		if !sequencedOnly && r.IntN(10) == 0 {
			n := r.IntN(4)
			return &idem.Message{ID: fmt.Sprintf("%s-plain-%d", agg, n), AggregateID: agg, Payload: []byte{byte(n)}}
		}
		id := fmt.Sprintf("%s-%d", agg, seq)
		if r.IntN(6) == 0 {
			id += "-other" // a second ID claiming the sequence
		}
		payload := []byte(id)
		if r.IntN(8) == 0 {
			payload = append(payload, '!') // the same ID with another payload
		}
		return &idem.Message{ID: id, AggregateID: agg, Seq: seq, Payload: payload}
	}
	alone := func(k int, m *idem.Message) idem.Outcome {
		out, err := procs[k].Process(ctx, hs[k], m)
		if err != nil && out == idem.OutcomeNone && !errors.Is(err, idem.ErrGap) {
			t.Fatalf("%s alone: %v", m.ID, err)
		}
		return out
	}
	for round := range 60 {
		n := 1 + r.IntN(10)
		msgs := make([]*idem.Message, n)
		for i := range msgs {
			msgs[i] = gen()
		}
		outs, err := procs[0].ProcessBatch(ctx, hs[0], msgs)
		if err != nil {
			t.Fatalf("round %d: batch: %v", round, err)
		}
		for i, out := range outs {
			if out == idem.OutcomeNone {
				outs[i] = alone(0, msgs[i])
			}
		}
		// The order the batch documents: each aggregate's sequenced
		// messages by sequence (the first delivered first), in the places
		// the batch gave that aggregate's sequenced messages.
		order := make([]int, n)
		places := map[string][]int{}
		for i, m := range msgs {
			order[i] = i
			if m.Seq > 0 {
				places[m.AggregateID] = append(places[m.AggregateID], i)
			}
		}
		for _, at := range places {
			group := slices.Clone(at)
			slices.SortStableFunc(group, func(x, y int) int { return int(msgs[x].Seq - msgs[y].Seq) })
			for k, p := range at {
				order[p] = group[k]
			}
		}
		want := make([]idem.Outcome, n)
		for _, i := range order {
			want[i] = alone(1, msgs[i])
		}
		for i := range msgs {
			if outs[i] != want[i] {
				var desc []string
				for j, m := range msgs {
					desc = append(desc, fmt.Sprintf("%s/%d %q: %v vs %v", m.ID, m.Seq, m.Payload, outs[j], want[j]))
				}
				t.Fatalf("round %d: message %d: batch then alone %v, one at a time %v\n%s", round, i, outs[i], want[i], strings.Join(desc, "\n"))
			}
		}
	}
	ga, err := a.states(ctx)
	if err != nil {
		t.Fatal(err)
	}
	gb, err := b.states(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Where an unsequenced message lands among its aggregate's sequenced
	// ones depends on which of those the batch applied: compare the
	// sequences in order, and how many unsequenced ones applied.
	if !maps.Equal(sequenced(ga), sequenced(gb)) {
		t.Fatalf("states after batches %v, one at a time %v", ga, gb)
	}
}

// sequenced maps each state to its sequences in order and, apart, the
// count of unsequenced messages (-1) in it.
func sequenced(states map[string]string) map[string]string {
	out := make(map[string]string, len(states))
	for agg, v := range states {
		var seqs []string
		plain := 0
		for _, q := range strings.Split(strings.TrimPrefix(v, ","), ",") {
			if q == "-1" {
				plain++
			} else {
				seqs = append(seqs, q)
			}
		}
		out[agg] = strings.Join(seqs, ",") + " +" + strconv.Itoa(plain)
	}
	return out
}

// TestBatchEqualsOneAtATime runs batchEquivalence on SQLite and
// PostgreSQL (whose batches advance the guard with other statements than
// single messages do) under each gap policy that decides at once, with
// markers, in version-only mode and with the in-row guard.
func TestBatchEqualsOneAtATime(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"markers", "version-only", "in-row"} {
		for _, gap := range []idem.GapPolicy{idem.GapFail, idem.GapAllow} {
			o := idem.Ordering{Gap: gap, VersionOnly: mode == "version-only"}
			inRow := mode == "in-row"
			for seed := range uint64(3) {
				t.Run(fmt.Sprintf("sqlite/%s/%s/%d", mode, gap, seed), func(t *testing.T) {
					batchEquivalence(t, sqliteChains(t), sqliteChains(t), o, inRow, seed)
				})
				t.Run(fmt.Sprintf("postgres/%s/%s/%d", mode, gap, seed), func(t *testing.T) {
					batchEquivalence(t, postgresChains(t), postgresChains(t), o, inRow, seed)
				})
			}
		}
	}
}

// batchAtMaxSeq: batches that reach the largest sequence apply it in
// order, and their redeliveries never wrap around, under every kind of
// guard: a run ending at math.MaxInt64 applies whole, after it the last
// sequence again is a Duplicate (Stale under another ID with markers), an
// older one Stale.
func batchAtMaxSeq[TTx any](t *testing.T, s *chainStore[TTx], mode string) {
	ctx := context.Background()
	p, err := idem.NewProcessor(s.drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[TTx]{Name: "chains", Ordering: &idem.Ordering{VersionOnly: mode == "version-only"},
		Apply: func(ctx context.Context, tx TTx, m *idem.Message) error {
			return s.append(ctx, tx, m.AggregateID, m.Seq)
		}}
	if mode == "in-row" {
		h.Apply, h.ApplyInRow = nil, s.row
	}
	allow := *h
	allow.Ordering = &idem.Ordering{Gap: idem.GapAllow, VersionOnly: h.Ordering.VersionOnly}
	msg := func(seq int64, id string) *idem.Message {
		if id == "" {
			id = "m-" + strconv.FormatInt(seq, 10)
		}
		return &idem.Message{ID: id, AggregateID: "a", Seq: seq, Payload: []byte(strconv.FormatInt(seq, 10))}
	}
	const top = math.MaxInt64
	outs, err := p.ProcessBatch(ctx, &allow, []*idem.Message{msg(top-3, "")})
	if err != nil || outs[0] != idem.Applied {
		t.Fatalf("GapAllow jump to MaxInt64-3: %v, %v", outs, err)
	}
	outs, err = p.ProcessBatch(ctx, h, []*idem.Message{msg(top, ""), msg(top-2, ""), msg(top-1, ""), msg(top-3, "")})
	want := []idem.Outcome{idem.Applied, idem.Applied, idem.Applied, idem.Duplicate}
	if err != nil || !slices.Equal(outs, want) {
		t.Fatalf("run up to MaxInt64: %v, %v; want %v", outs, err, want)
	}
	again := idem.Duplicate
	if mode == "markers" {
		again = idem.Stale // another ID claiming the last sequence
	}
	outs, err = p.ProcessBatch(ctx, h, []*idem.Message{msg(top, "other"), msg(top-1, "older"), msg(top, "")})
	want = []idem.Outcome{again, idem.Stale, idem.Duplicate}
	if err != nil || !slices.Equal(outs, want) {
		t.Fatalf("redeliveries at MaxInt64: %v, %v; want %v", outs, err, want)
	}
	got, err := s.states(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if w := fmt.Sprintf(",%d,%d,%d,%d", int64(top-3), int64(top-2), int64(top-1), int64(top)); got["a"] != w || len(got) != 1 {
		t.Fatalf("states %v, want a=%s", got, w)
	}
}

// TestBatchAtMaxSeq runs batchAtMaxSeq on SQLite and PostgreSQL.
func TestBatchAtMaxSeq(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"markers", "version-only", "in-row"} {
		t.Run("sqlite/"+mode, func(t *testing.T) { batchAtMaxSeq(t, sqliteChains(t), mode) })
		t.Run("postgres/"+mode, func(t *testing.T) { batchAtMaxSeq(t, postgresChains(t), mode) })
	}
}
