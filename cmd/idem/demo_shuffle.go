package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
)

// orderedHandler names the handler of the --shuffle demo.
const orderedHandler = "demo-ordered-balances"

// chainMod keeps the order-sensitive checksum small enough for SQLite
// integers: chain' = (chain·31 + amount + 1,000,000) mod chainMod.
const chainMod = 1_000_000_007

// orderedEvent is one intended event with its per-account sequence.
type orderedEvent struct {
	demoEvent
	Seq int64
}

// runShuffleDemo shows the ordering guard: every account's events carry a
// sequence, deliveries are reordered within windows and duplicated, and the
// projection keeps an order-sensitive checksum per account, so applying
// events out of order — not only twice — would be caught by the
// verification.
func runShuffleDemo(ctx context.Context, e *env, cfg *demoConfig) error {
	path := cfg.db
	if path == "" {
		dir, err := os.MkdirTemp("", "idem-demo-")
		if err != nil {
			return fmt.Errorf("create temporary directory: %w", err)
		}
		defer os.RemoveAll(dir)
		path = filepath.Join(dir, "demo.db")
	}
	db, drv, err := openDemoDB(ctx, path, `CREATE TABLE demo_ordered (account TEXT PRIMARY KEY, amount INTEGER NOT NULL,
last_seq INTEGER NOT NULL, chain INTEGER NOT NULL) WITHOUT ROWID`)
	if err != nil {
		return err
	}
	defer db.Close()
	logger := slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	proc, rec, err := newDemoProcessor(drv, logger)
	if err != nil {
		return err
	}

	names := newDemoNames(cfg)
	base := demoEvents(cfg, names)
	events := make([]orderedEvent, len(base))
	perAccount := make([]int64, cfg.accounts)
	for i, ev := range base {
		perAccount[ev.Account]++
		events[i] = orderedEvent{demoEvent: ev, Seq: perAccount[ev.Account]}
	}
	r := rand.New(rand.NewPCG(cfg.seed, 0x5eed))
	// Redeliveries come after their original, anywhere later in the stream;
	// then the order is perturbed within windows: the temporary reordering
	// that redelivery and rebalancing produce.
	type keyed struct {
		key float64
		ev  orderedEvent
	}
	ks := make([]keyed, 0, len(events)+int(float64(len(events))*cfg.dupRate)+1)
	for i, ev := range events {
		ks = append(ks, keyed{float64(i), ev})
	}
	for range int(float64(len(events)) * cfg.dupRate) {
		i := r.IntN(len(events))
		ks = append(ks, keyed{float64(i) + r.Float64()*float64(len(events)-i), events[i]})
	}
	slices.SortStableFunc(ks, func(a, b keyed) int { return cmp.Compare(a.key, b.key) })
	stream := make([]orderedEvent, len(ks))
	for i, k := range ks {
		stream[i] = k.ev
	}
	for lo := 0; lo < len(stream); lo += cfg.window {
		w := stream[lo:min(lo+cfg.window, len(stream))]
		r.Shuffle(len(w), func(i, j int) { w[i], w[j] = w[j], w[i] })
	}

	fmt.Fprintf(e.stdout, "idem demo --shuffle: ordered account balances on SQLite (synchronous=FULL) at %s\n", path)
	fmt.Fprintf(e.stdout, "  %d intended events over %d accounts, each with a per-account sequence (seed %d)\n", len(events), cfg.accounts, cfg.seed)
	fmt.Fprintf(e.stdout, "  stream: %d deliveries (%d redeliveries), reordered within windows of %d\n", len(stream), len(stream)-len(events), cfg.window)
	fmt.Fprintf(e.stdout, "  %d workers, accounts partitioned across them; gap policy wait: an early event is held and retried\n", cfg.workers)

	h := &idem.Handler[*sql.Tx]{
		Name:     orderedHandler,
		Ordering: &idem.Ordering{Gap: idem.GapWait, WaitFor: time.Hour},
		Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
			amount, err := strconv.ParseInt(m.Headers["amount"], 10, 64)
			if err != nil {
				return idem.Permanent(fmt.Errorf("amount header: %w", err))
			}
			_, err = tx.ExecContext(ctx, `INSERT INTO demo_ordered (account, amount, last_seq, chain) VALUES (?1, ?2, ?3, (?2 + 1000000) % ?4)
ON CONFLICT (account) DO UPDATE SET amount = amount + ?2, last_seq = ?3, chain = (chain * 31 + ?2 + 1000000) % ?4`,
				m.AggregateID, amount, m.Seq, chainMod)
			return err
		},
	}
	if cfg.noGuard {
		h.Ordering = nil
	}

	parts := make([][]orderedEvent, cfg.workers)
	for _, ev := range stream {
		w := ev.Account % cfg.workers
		parts[w] = append(parts[w], ev)
	}
	var applied, duplicates, stale, held, done atomic.Int64
	prog := newProgress(e.stdout, int64(len(stream)), "deliveries")
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, cfg.workers)
	for w := range cfg.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var parked []orderedEvent
			deliver := func(ev orderedEvent) (bool, error) {
				out, err := proc.Process(ctx, h, orderedMessage(names, ev))
				var ge *idem.GapError
				switch {
				case errors.As(err, &ge) && !ge.Final:
					return false, nil
				case err != nil:
					return false, fmt.Errorf("%s: %w", ev.ID, err)
				case out == idem.Applied:
					applied.Add(1)
				case out == idem.Duplicate:
					duplicates.Add(1)
				case out == idem.Stale:
					stale.Add(1)
				}
				done.Add(1)
				prog.Add(1)
				return true, nil
			}
			for _, ev := range parts[w] {
				ok, err := deliver(ev)
				if err != nil {
					errs <- err
					return
				}
				if !ok {
					held.Add(1)
					parked = append(parked, ev)
					continue
				}
				// Something moved: retry the held deliveries until none can.
				for progress := true; progress && len(parked) > 0; {
					progress = false
					for i := 0; i < len(parked); i++ {
						ok, err := deliver(parked[i])
						if err != nil {
							errs <- err
							return
						}
						if ok {
							parked = append(parked[:i], parked[i+1:]...)
							i--
							progress = true
						}
					}
				}
			}
			if len(parked) > 0 {
				errs <- fmt.Errorf("%d deliveries still held at the end of the stream (first %s, seq %d)", len(parked), parked[0].ID, parked[0].Seq)
			}
		}()
	}
	wg.Wait()
	prog.Finish()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	elapsed := time.Since(start)
	if err := rec.Flush(ctx); err != nil {
		return err
	}

	// Expected per account, from the unique intended events in sequence
	// order (the generation order), never from the delivered stream.
	type want struct{ amount, seq, chain int64 }
	exp := make([]want, cfg.accounts)
	for _, ev := range events {
		x := &exp[ev.Account]
		x.amount += ev.Amount
		x.seq = ev.Seq
		x.chain = ((x.chain*31+ev.Amount+1_000_000)%chainMod + chainMod) % chainMod
	}
	rows, err := db.QueryContext(ctx, `SELECT account, amount, last_seq, chain FROM demo_ordered`)
	if err != nil {
		return fmt.Errorf("read projection: %w", err)
	}
	got := map[string]want{}
	for rows.Next() {
		var a string
		var x want
		if err := rows.Scan(&a, &x.amount, &x.seq, &x.chain); err != nil {
			rows.Close()
			return err
		}
		got[a] = x
	}
	rows.Close()
	var bad []string
	for i, x := range exp {
		if x.seq == 0 {
			continue
		}
		g := got[names.account(i)]
		if g.amount != x.amount || g.seq != x.seq || ((g.chain%chainMod)+chainMod)%chainMod != x.chain {
			bad = append(bad, fmt.Sprintf("%s: amount %d seq %d chain %d, want %d %d %d", names.account(i), g.amount, g.seq, g.chain, x.amount, x.seq, x.chain))
		}
	}
	rate := float64(len(stream)) / elapsed.Seconds()
	fmt.Fprintf(e.stdout, "\n  %-26s %9d\n  %-26s %9d\n  %-26s %9d\n  %-26s %9d\n  %-26s %9d\n  %-26s %9d\n  %-26s %9s\n  %-26s %9.0f\n\n",
		"events intended", len(events), "deliveries", len(stream), "applied (in order)", applied.Load(),
		"duplicates skipped", duplicates.Load(), "stale skipped", stale.Load(),
		"early, held and retried", held.Load(), "elapsed", elapsed.Round(time.Millisecond), "deliveries/s", rate)
	if len(bad) > 0 || applied.Load() != int64(len(events)) {
		fmt.Fprintf(e.stdout, "verification: FAILED — %d accounts differ, %d of %d events applied\n", len(bad), applied.Load(), len(events))
		for _, b := range bad[:min(10, len(bad))] {
			fmt.Fprintln(e.stdout, "  "+b)
		}
		return errors.New("verification failed: see the report above")
	}
	fmt.Fprintln(e.stdout, "verification: OK — every balance, last sequence and order checksum matches the unique intended events applied in order")
	return nil
}

func orderedMessage(names demoNames, ev orderedEvent) *idem.Message {
	return &idem.Message{
		ID:          ev.ID,
		Type:        "BalanceChanged",
		AggregateID: names.account(ev.Account),
		Seq:         ev.Seq,
		Payload:     []byte(ev.ID + ":" + strconv.FormatInt(ev.Amount, 10)),
		Headers:     map[string]string{"amount": strconv.FormatInt(ev.Amount, 10)},
	}
}
