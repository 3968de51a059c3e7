package main

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/sqlident"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// chaosBroker is the broker side of a run: a JetStream cluster of node
// processes, or an in-process Kafka-protocol cluster.
type chaosBroker interface {
	describe() string
	// urls are what the children connect to.
	urls() []string
	// stream is what consumers read: the JetStream stream or the topic.
	stream() string
	// subject is what the producer writes to: the outbox rows' Stream.
	subject() string
	// nodes are the broker processes the run may kill; none for Kafka.
	nodes() []*chaosProc
	// leader names the node leading the stream, or "".
	leader(ctx context.Context) string
	// healthy reports whether a node may die now without costing quorum.
	healthy(ctx context.Context) bool
	// waitNode waits until a restarted node accepts connections.
	waitNode(ctx context.Context, p *chaosProc) error
	close()
}

// chaosEvent is one intended event, as the producer committed it.
type chaosEvent struct {
	id, account string
	amount, seq int64
}

// chaosKill is one SIGKILL of the run.
type chaosKill struct {
	kind, name string
	leader     bool
	at         time.Duration // since the run started
}

// chaosHarness is one run: its store, sink, broker and processes.
type chaosHarness struct {
	cfg    *chaosConfig
	logger *slog.Logger
	procs  *chaosProcs
	dir    string
	schema string
	pool   *pgxpool.Pool
	drv    *postgres.Driver
	tables chaosTables
	sink   *chaosSink
	broker chaosBroker

	consumers, relays []*chaosProc
	started           time.Time

	// events are written by the producer alone until it returns.
	events   []chaosEvent
	produced atomic.Int64

	mu       sync.Mutex
	kills    []chaosKill
	deferred int // node kills turned into consumer kills while the cluster caught up
	stalls   []chaosStall
}

// chaosStall is a time a handler made no progress while events waited.
type chaosStall struct {
	handler string
	from    time.Duration // since the run started
	length  time.Duration
}

// newChaosHarness sets up the store, the sink and the broker of a run.
func newChaosHarness(ctx context.Context, cfg *chaosConfig, logger *slog.Logger) (_ *chaosHarness, err error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("chaos: find this program to start its processes: %w", err)
	}
	dir, err := os.MkdirTemp("", "idem-chaos-")
	if err != nil {
		return nil, fmt.Errorf("chaos: temporary directory: %w", err)
	}
	h := &chaosHarness{cfg: cfg, logger: logger, dir: dir, procs: &chaosProcs{exe: exe, dir: dir}}
	defer func() {
		if err != nil {
			h.close(ctx, true)
		}
	}()
	pcfg, err := parsePostgresDSN(cfg.dsn)
	if err != nil {
		return nil, usagef("--dsn: %w", err)
	}
	pcfg.MaxConns = 4
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if h.pool, err = pgxpool.NewWithConfig(pctx, pcfg); err == nil {
		err = h.pool.Ping(pctx)
	}
	if err != nil {
		return nil, fmt.Errorf("chaos: PostgreSQL at %s: %w", pcfg.ConnConfig.Host, err)
	}
	b := make([]byte, 6)
	_, _ = crand.Read(b)
	h.schema = "idem_chaos_" + hex.EncodeToString(b)
	if _, err = h.pool.Exec(ctx, `CREATE SCHEMA `+sqlident.Quote(h.schema)); err != nil {
		h.schema = ""
		return nil, fmt.Errorf("chaos: create schema: %w", err)
	}
	if h.drv, err = postgres.New(h.pool, &postgres.Config{Schema: h.schema, Logger: logger}); err != nil {
		return nil, err
	}
	if err = h.drv.Migrate(ctx); err != nil {
		return nil, err
	}
	h.tables = newChaosTables(h.schema)
	for _, q := range h.tables.ddl() {
		if _, err = h.pool.Exec(ctx, q); err != nil {
			return nil, fmt.Errorf("chaos: create the projections: %w", err)
		}
	}
	if h.sink, err = newChaosSink(); err != nil {
		return nil, fmt.Errorf("chaos: sink: %w", err)
	}
	switch cfg.broker {
	case "kafka":
		h.broker, err = newChaosKafka()
	default:
		h.broker, err = newChaosNATS(ctx, h.procs)
	}
	if err != nil {
		return nil, err
	}
	return h, nil
}

// childSpec is the description of a consumer or relay process.
func (h *chaosHarness) childSpec(role, name string) chaosChild {
	return chaosChild{Role: role, Name: name, Broker: h.cfg.broker, URLs: h.broker.urls(), DSN: h.cfg.dsn,
		Schema: h.schema, Stream: h.broker.stream(), SinkURL: h.sink.url}
}

// startRelays starts the relay processes.
func (h *chaosHarness) startRelays() error {
	for i := range h.cfg.relays {
		p := h.procs.newProc(h.childSpec("relay", fmt.Sprintf("relay-%d", i)))
		if err := h.procs.start(p); err != nil {
			return err
		}
		h.relays = append(h.relays, p)
	}
	return nil
}

// startConsumers starts n consumer processes.
func (h *chaosHarness) startConsumers(n int) error {
	for i := range n {
		p := h.procs.newProc(h.childSpec("consumer", fmt.Sprintf("consumer-%d", i)))
		if err := h.procs.start(p); err != nil {
			return err
		}
		h.consumers = append(h.consumers, p)
	}
	return nil
}

// startAll starts the relays and n consumers.
func (h *chaosHarness) startAll(n int) error {
	if err := h.startRelays(); err != nil {
		return err
	}
	return h.startConsumers(n)
}

// close stops every process, closes the broker and the sink, drops the
// schema unless --keep, and removes the directory of logs when clean.
func (h *chaosHarness) close(ctx context.Context, clean bool) {
	for _, p := range slices.Concat(h.consumers, h.relays) {
		p.stop()
	}
	if h.broker != nil {
		h.broker.close()
	}
	if h.sink != nil {
		h.sink.close()
	}
	if h.pool != nil {
		if h.schema != "" && !h.cfg.keep {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			if _, err := h.pool.Exec(dctx, `DROP SCHEMA `+sqlident.Quote(h.schema)+` CASCADE`); err != nil {
				h.logger.Warn("chaos: drop the run's schema", "schema", h.schema, "err", err)
			}
			cancel()
		}
		h.pool.Close()
	}
	if clean {
		os.RemoveAll(h.dir)
	}
}

// produce commits events through the outbox at the configured rate until
// deadline, or, with n > 0, commits n events as fast as it can.
func (h *chaosHarness) produce(ctx context.Context, deadline time.Time, n int) error {
	rng := chaosRNG(h.cfg.seed, chaosRandEvents)
	ob, err := outbox.New(h.drv)
	if err != nil {
		return err
	}
	names := demoNames{accountWidth: max(4, len(fmt.Sprint(h.cfg.accounts-1)))}
	seqs := map[string]int64{} // committed events per account
	start := time.Now()
	for {
		want := n - len(h.events)
		if n == 0 {
			if !time.Now().Before(deadline) {
				return nil
			}
			want = int(float64(h.cfg.rate)*time.Since(start).Seconds()) - len(h.events)
		}
		if n > 0 && want == 0 {
			return nil
		}
		if want = min(want, 500); want > 0 {
			if err := h.produceBatch(ctx, ob, rng, names, seqs, want); err != nil {
				return err
			}
		}
		if n == 0 {
			sleepCtx(ctx, 20*time.Millisecond)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// produceBatch commits n events in one transaction and checks that the
// outbox gave each its account's next sequence.
func (h *chaosHarness) produceBatch(ctx context.Context, ob *outbox.Outbox[postgres.Tx], rng *rand.Rand, names demoNames, seqs map[string]int64, n int) error {
	batch := make([]chaosEvent, 0, n)
	next := map[string]int64{}
	tx, err := h.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("chaos: producer: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for range n {
		acct := names.account(rng.IntN(h.cfg.accounts))
		amount := rng.Int64N(1000) - 400
		payload, _ := json.Marshal(chaosPayload{Amount: amount}) // cannot fail
		m, err := ob.AddNext(ctx, tx, h.broker.subject(), acct, "Moved", payload)
		if err != nil {
			return fmt.Errorf("chaos: producer: %w", err)
		}
		if _, ok := next[acct]; !ok {
			next[acct] = seqs[acct]
		}
		next[acct]++
		if m.Seq != next[acct] {
			return fmt.Errorf("chaos: producer: the outbox gave %s sequence %d, want %d", acct, m.Seq, next[acct])
		}
		batch = append(batch, chaosEvent{id: m.ID, account: acct, amount: amount, seq: m.Seq})
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("chaos: producer: commit (whether these %d events exist is unknown): %w", len(batch), err)
	}
	maps.Copy(seqs, next)
	h.events = append(h.events, batch...)
	h.produced.Store(int64(len(h.events)))
	return nil
}

// chaosProgress is how far each handler got.
type chaosProgress struct {
	produced int64
	applied  map[string]int64
}

// behind reports whether some handler has not yet applied every produced
// event.
func (p chaosProgress) behind() bool {
	for _, n := range p.applied {
		if n < p.produced {
			return true
		}
	}
	return false
}

// progress reads how many events each handler has applied.
func (h *chaosHarness) progress(ctx context.Context) (chaosProgress, error) {
	p := chaosProgress{produced: h.produced.Load(), applied: map[string]int64{}}
	var b, o int64
	err := h.pool.QueryRow(ctx, `SELECT (SELECT coalesce(sum(n), 0) FROM `+h.tables.balances+`)::bigint,
		(SELECT coalesce(sum(n), 0) FROM `+h.tables.ordered+`)::bigint`).Scan(&b, &o)
	if err != nil {
		return p, fmt.Errorf("chaos: read progress: %w", err)
	}
	p.applied[chaosBalances], p.applied[chaosOrdered], p.applied[chaosSinkHandler] = b, o, h.sink.effects()
	return p, nil
}

// monitor polls the progress until ctx ends, records every stall (a
// handler making no progress while behind, once it has applied its first
// event) and prints a line every 10 seconds.
func (h *chaosHarness) monitor(ctx context.Context, out io.Writer) {
	last := map[string]int64{}
	since := map[string]time.Time{}
	nextLine := time.Now().Add(10 * time.Second)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		p, err := h.progress(ctx)
		if err != nil {
			continue
		}
		now := time.Now()
		for _, name := range chaosHandlers {
			n := p.applied[name]
			if n == 0 {
				continue // starting: the processes connect, the durables are made
			}
			if s, ok := since[name]; !ok || n != last[name] || n >= p.produced {
				if ok && n != last[name] && now.Sub(s) >= 200*time.Millisecond {
					h.mu.Lock()
					h.stalls = append(h.stalls, chaosStall{handler: name, from: s.Sub(h.started), length: now.Sub(s)})
					h.mu.Unlock()
				}
				last[name], since[name] = n, now
			}
		}
		if now.After(nextLine) {
			nextLine = now.Add(10 * time.Second)
			h.mu.Lock()
			kills := len(h.kills)
			h.mu.Unlock()
			fmt.Fprintf(out, "  %5.0fs  produced %d; applied: balances %d, ordered %d, sink %d; %d kills\n",
				now.Sub(h.started).Seconds(), p.produced, p.applied[chaosBalances], p.applied[chaosOrdered], p.applied[chaosSinkHandler], kills)
		}
	}
}

// killLoop kills one process about every --kill-every until deadline and
// starts it again.
func (h *chaosHarness) killLoop(ctx context.Context, deadline time.Time) error {
	rng := chaosRNG(h.cfg.seed, chaosRandKills)
	kinds := []string{"consumer", "relay"}
	if len(h.broker.nodes()) > 0 {
		kinds = append(kinds, "node")
	}
	every := float64(h.cfg.killEvery)
	for {
		// Draw the same values every turn, so the choices follow the seed.
		wait := time.Duration(every * (0.5 + rng.Float64()))
		kind := kinds[rng.IntN(len(kinds))]
		idx := rng.IntN(1 << 20)
		wantLeader := rng.IntN(2) == 0
		down := time.Duration(every/10 + rng.Float64()*every/3)
		if time.Now().Add(wait).After(deadline) {
			sleepCtx(ctx, time.Until(deadline))
			return ctx.Err()
		}
		sleepCtx(ctx, wait)
		if err := ctx.Err(); err != nil {
			return err
		}
		if h.cfg.noKill {
			continue
		}
		var p *chaosProc
		leader := false
		switch kind {
		case "relay":
			p = h.relays[idx%len(h.relays)]
		case "node":
			if !h.waitHealthy(ctx, 10*time.Second) {
				// A node still catching up: killing another could cost
				// the quorum.
				h.mu.Lock()
				h.deferred++
				h.mu.Unlock()
				kind = "consumer"
				p = h.consumers[idx%len(h.consumers)]
				break
			}
			nodes := h.broker.nodes()
			p = nodes[idx%len(nodes)]
			l := h.broker.leader(ctx)
			if wantLeader {
				for _, n := range nodes {
					if n.name == l {
						p = n
					}
				}
			}
			leader = p.name == l
		default:
			p = h.consumers[idx%len(h.consumers)]
		}
		h.mu.Lock()
		h.kills = append(h.kills, chaosKill{kind: kind, name: p.name, leader: leader, at: time.Since(h.started)})
		h.mu.Unlock()
		p.kill()
		sleepCtx(ctx, down)
		if err := h.procs.start(p); err != nil {
			return err
		}
		if kind == "node" {
			if err := h.broker.waitNode(ctx, p); err != nil {
				return err
			}
		}
	}
}

// waitHealthy waits up to d for the broker to be healthy and reports
// whether it is.
func (h *chaosHarness) waitHealthy(ctx context.Context, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !h.broker.healthy(ctx) {
		if ctx.Err() != nil || time.Now().After(deadline) {
			return false
		}
		sleepCtx(ctx, 200*time.Millisecond)
	}
	return true
}

// waitDrained waits until every handler has applied every produced event
// and the outbox is empty, or the drain timeout passes.
func (h *chaosHarness) waitDrained(ctx context.Context, timeout time.Duration) error {
	start := time.Now()
	for {
		p, err := h.progress(ctx)
		if err != nil {
			return err
		}
		st, err := h.drv.OutboxStats(ctx)
		if err != nil {
			return fmt.Errorf("chaos: outbox stats: %w", err)
		}
		if !p.behind() && st.Pending == 0 {
			return nil
		}
		if time.Since(start) > timeout {
			return fmt.Errorf("chaos: not drained within %s: of %d events, balances applied %d, ordered %d, sink %d; %d outbox rows pending; %s",
				timeout, p.produced, p.applied[chaosBalances], p.applied[chaosOrdered], p.applied[chaosSinkHandler], st.Pending, h.sinkState(ctx))
		}
		sleepCtx(ctx, 100*time.Millisecond)
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// sinkState describes the lease handler's rows and the sink's calls, for
// a run that did not drain: whether the missing effects were never
// claimed, are held, or failed.
func (h *chaosHarness) sinkState(ctx context.Context) string {
	var done, running, failed, maxAttempts int64
	err := h.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'done'), count(*) FILTER (WHERE status = 'running'),
count(*) FILTER (WHERE status = 'failed'), coalesce(max(attempts), 0) FROM `+sqlident.Qualified(h.schema, "idem_processed")+`
WHERE handler = $1`, chaosSinkHandler).Scan(&done, &running, &failed, &maxAttempts)
	h.sink.mu.Lock()
	calls, fenced := h.sink.calls, h.sink.fenced
	h.sink.mu.Unlock()
	if err != nil {
		return fmt.Sprintf("sink leases unreadable (%v); sink calls %d, fenced %d", err, calls, fenced)
	}
	return fmt.Sprintf("sink leases %d done, %d running, %d failed (most attempts %d); sink calls %d, fenced %d",
		done, running, failed, maxAttempts, calls, fenced)
}

// chaosResult is what a run did and what its check found.
type chaosResult struct {
	events   int
	accounts int
	elapsed  time.Duration
	drained  time.Duration
	kills    []chaosKill
	deferred int
	stalls   []chaosStall
	counts   map[string]chaosCountsJSON
	calls    int64
	effects  int64
	repeated int // keys called more than once
	fenced   int64
	overlaps int64
	problems []string
}

// run produces and kills for the run's duration, drains, and verifies.
func (h *chaosHarness) run(ctx context.Context, out io.Writer) (*chaosResult, error) {
	h.started = time.Now()
	deadline := h.started.Add(h.cfg.duration)
	mctx, stopMonitor := context.WithCancel(ctx)
	defer stopMonitor()
	go h.monitor(mctx, out)
	prodErr := make(chan error, 1)
	go func() { prodErr <- h.produce(ctx, deadline, 0) }()
	killErr := h.killLoop(ctx, deadline)
	if err := <-prodErr; err != nil {
		return nil, err
	}
	if killErr != nil {
		return nil, killErr
	}
	drainStart := time.Now()
	if err := h.waitDrained(ctx, h.cfg.drainTimeout); err != nil {
		return nil, err
	}
	drained := time.Since(drainStart)
	// What a killed consumer left unacknowledged comes back after the ack
	// wait: give it time to arrive and be found a duplicate.
	sleepCtx(ctx, chaosAckWait+time.Second)
	stopMonitor()
	for _, p := range slices.Concat(h.consumers, h.relays) {
		p.stop() // the consumers send their last counts
	}
	res := &chaosResult{events: len(h.events), accounts: h.cfg.accounts, elapsed: time.Since(h.started), drained: drained}
	h.mu.Lock()
	res.kills, res.deferred, res.stalls = h.kills, h.deferred, h.stalls
	h.mu.Unlock()
	res.counts = h.sink.totals()
	if err := h.verify(ctx, res); err != nil {
		return nil, err
	}
	return res, nil
}

// verify checks the final state against the intended events and notes
// every difference in res.problems.
func (h *chaosHarness) verify(ctx context.Context, res *chaosResult) error {
	type want struct{ amount, n, lastSeq int64 }
	wants := map[string]*want{}
	for _, ev := range h.events {
		w := wants[ev.account]
		if w == nil {
			w = &want{}
			wants[ev.account] = w
		}
		w.amount += ev.amount
		w.n++
		w.lastSeq = max(w.lastSeq, ev.seq)
	}
	var bad []string
	rows, err := h.pool.Query(ctx, `SELECT b.account, b.amount, b.n, coalesce(o.last_seq, -1), coalesce(o.n, -1), coalesce(o.bad, -1)
		FROM `+h.tables.balances+` b FULL JOIN `+h.tables.ordered+` o ON o.account = b.account`)
	if err != nil {
		return fmt.Errorf("chaos: read the projections: %w", err)
	}
	seen := map[string]bool{}
	for rows.Next() {
		var acct *string
		var amount, n, lastSeq, on, obad int64
		if err := rows.Scan(&acct, &amount, &n, &lastSeq, &on, &obad); err != nil {
			rows.Close()
			return fmt.Errorf("chaos: read the projections: %w", err)
		}
		if acct == nil {
			bad = append(bad, "an ordered row without a balance")
			continue
		}
		seen[*acct] = true
		w := wants[*acct]
		if w == nil {
			bad = append(bad, fmt.Sprintf("%s: a balance for no intended event", *acct))
			continue
		}
		if amount != w.amount || n != w.n {
			bad = append(bad, fmt.Sprintf("%s: balance %d from %d events, want %d from %d", *acct, amount, n, w.amount, w.n))
		}
		if lastSeq != w.lastSeq || on != w.n || obad != 0 {
			bad = append(bad, fmt.Sprintf("%s: ordered handler at sequence %d after %d writes, %d out of order; want %d, %d, 0", *acct, lastSeq, on, obad, w.lastSeq, w.n))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("chaos: read the projections: %w", err)
	}
	for a := range wants {
		if !seen[a] {
			bad = append(bad, fmt.Sprintf("%s: no balance, want %d events", a, wants[a].n))
		}
	}
	slices.Sort(bad)
	if len(bad) > 0 {
		res.problems = append(res.problems, fmt.Sprintf("%d accounts differ from the intended events: %s", len(bad), strings.Join(bad[:min(len(bad), 10)], "; ")))
	}

	// The sink: every intended event's key applied once, no other key.
	h.sink.mu.Lock()
	intended := map[string]bool{}
	var missing []string
	for _, ev := range h.events {
		key := idem.IdempotencyKey(chaosSinkHandler, ev.id)
		intended[key] = true
		if k := h.sink.keys[key]; k == nil || k.effects != 1 {
			missing = append(missing, ev.id)
		}
	}
	extra := 0
	for key, k := range h.sink.keys {
		if !intended[key] {
			extra++
		}
		if k.calls > 1 {
			res.repeated++
		}
	}
	res.calls, res.effects, res.fenced, res.overlaps = h.sink.calls, h.sink.applied, h.sink.fenced, h.sink.overlaps
	h.sink.mu.Unlock()
	if len(missing) > 0 {
		res.problems = append(res.problems, fmt.Sprintf("the sink has no effect for %d events: %s", len(missing), strings.Join(missing[:min(len(missing), 10)], ", ")))
	}
	if extra > 0 {
		res.problems = append(res.problems, fmt.Sprintf("the sink was called with %d keys of no intended event", extra))
	}
	if res.overlaps > 0 {
		res.problems = append(res.problems, fmt.Sprintf("the sink saw %d calls for a key while another call for it ran: two lease holders at once", res.overlaps))
	}

	st, err := h.drv.OutboxStats(ctx)
	if err != nil {
		return fmt.Errorf("chaos: outbox stats: %w", err)
	}
	if st.Pending != 0 {
		res.problems = append(res.problems, fmt.Sprintf("%d outbox rows unpublished", st.Pending))
	}
	dls, err := h.drv.DeadLetterList(ctx, &driver.DeadLetterFilter{Limit: 5})
	if err != nil {
		return fmt.Errorf("chaos: dead letters: %w", err)
	}
	if len(dls) > 0 {
		var s []string
		for _, d := range dls {
			s = append(s, fmt.Sprintf("%s %s: %s", d.Handler, d.MessageID, d.Error))
		}
		res.problems = append(res.problems, fmt.Sprintf("dead letters: %s", strings.Join(s, "; ")))
	}
	if died := h.procs.died(); len(died) > 0 {
		res.problems = append(res.problems, fmt.Sprintf("processes died unkilled: %s", strings.Join(died, "; ")))
	}
	if res.events == 0 {
		res.problems = append(res.problems, "no event was produced")
	}
	return nil
}

// printChaosSummary prints the run's summary and verdict, and reports
// whether it passed.
func printChaosSummary(w io.Writer, cfg *chaosConfig, r *chaosResult) bool {
	byKind := map[string]int{}
	leaders := 0
	for _, k := range r.kills {
		byKind[k.kind]++
		if k.leader {
			leaders++
		}
	}
	kills := fmt.Sprintf("%d: consumer %d, relay %d", len(r.kills), byKind["consumer"], byKind["relay"])
	if cfg.broker == "nats" {
		kills += fmt.Sprintf(", node %d (stream leader %d)", byKind["node"], leaders)
		if r.deferred > 0 {
			kills += fmt.Sprintf("; %d node kills made consumer kills while a node caught up", r.deferred)
		}
	}
	per := func(f func(c chaosCountsJSON) int64) string {
		var parts []string
		for _, h := range chaosHandlers {
			parts = append(parts, fmt.Sprintf("%s %d", strings.TrimPrefix(h, "chaos."), f(r.counts[h])))
		}
		return strings.Join(parts, ", ")
	}
	longest, byKindStall := chaosLongestStalls(r)
	redeliveries := per(func(c chaosCountsJSON) int64 { return c.Redeliveries }) + "  (JetStream's delivery count)"
	if cfg.broker == "kafka" {
		redeliveries = "-  (Kafka counts none: a replay after a rebalance shows as duplicates)"
	}
	fmt.Fprintln(w)
	printRows(w, [][2]string{
		{"events intended", fmt.Sprintf("%d over %d accounts", r.events, r.accounts)},
		{"kills", kills},
		{"deliveries", per(func(c chaosCountsJSON) int64 { return c.Deliveries })},
		{"redeliveries", redeliveries},
		{"duplicates absorbed", per(func(c chaosCountsJSON) int64 { return c.Duplicates + c.Stale })},
		{"retried", per(func(c chaosCountsJSON) int64 { return c.Retried }) + "  (ordered: waits for an earlier sequence)"},
		{"dead-lettered", per(func(c chaosCountsJSON) int64 { return c.Dead })},
		{"sink calls / effects", fmt.Sprintf("%d / %d  (%d keys called more than once, %d calls refused for a stale fencing token)", r.calls, r.effects, r.repeated, r.fenced)},
		{"longest stall", longest},
		{"longest stall by kill", byKindStall},
		{"drained in", r.drained.Round(10 * time.Millisecond).String()},
		{"elapsed", r.elapsed.Round(10 * time.Millisecond).String()},
	})
	fmt.Fprintf(w, "  (counts are what the consumers reported: a killed process's last %s is missing)\n\n", chaosReportEvery)
	if len(r.problems) > 0 {
		fmt.Fprintf(w, "verification: FAILED — %s\n", strings.Join(r.problems, "; "))
		return false
	}
	fmt.Fprintf(w, "verification: OK — %d events: every balance and count as intended, every account in order, one sink effect per key, outbox empty, no dead letter\n", r.events)
	return true
}

// chaosLongestStalls describes the longest stall, and the longest after
// each kind of kill: a stall is put down to the last kill before it began
// (or within a second after).
func chaosLongestStalls(r *chaosResult) (string, string) {
	var longest chaosStall
	byKind := map[string]time.Duration{}
	cause := func(s chaosStall) *chaosKill {
		var k *chaosKill
		for i := range r.kills {
			if r.kills[i].at <= s.from+time.Second {
				k = &r.kills[i]
			}
		}
		return k
	}
	for _, s := range r.stalls {
		if s.length > longest.length {
			longest = s
		}
		if k := cause(s); k != nil {
			kind := k.kind
			if k.leader {
				kind = "node (leader)"
			}
			byKind[kind] = max(byKind[kind], s.length)
		}
	}
	if longest.length == 0 {
		return "none over 200ms", "-"
	}
	desc := fmt.Sprintf("%s (%s, from %.1fs", longest.length.Round(10*time.Millisecond), longest.handler, longest.from.Seconds())
	if k := cause(longest); k != nil {
		desc += fmt.Sprintf("; last kill: %s %s at %.1fs", k.kind, k.name, k.at.Seconds())
	}
	desc += ")"
	var parts []string
	for _, kind := range []string{"consumer", "relay", "node", "node (leader)"} {
		if d, ok := byKind[kind]; ok {
			parts = append(parts, fmt.Sprintf("%s %s", kind, d.Round(10*time.Millisecond)))
		}
	}
	if len(parts) == 0 {
		return desc, "-"
	}
	return desc, strings.Join(parts, ", ")
}
