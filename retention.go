package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemhq/idem/driver"
)

// Defaults of RetentionConfig.
const (
	// DefaultRetention is how long markers are kept: a redelivery older
	// than this would be applied again.
	DefaultRetention = 7 * 24 * time.Hour
	// DefaultPruneBatch is the most markers one pruning transaction
	// deletes.
	DefaultPruneBatch = 5000
	// DefaultPruneBatchTime is how long one pruning transaction of
	// markers should take at most; see RetentionConfig.BatchTime.
	DefaultPruneBatchTime = 40 * time.Millisecond
)

// minPruneBatch is the fewest markers a batch sized down by BatchTime
// deletes.
const minPruneBatch = 100

// ErrRetentionTooShort is matched (errors.Is) by a *RetentionError.
var ErrRetentionTooShort = errors.New("idem: retention shorter than the redelivery horizon")

// ErrMaintenanceBusy is returned by Pruner.Prune when another instance
// holds the maintenance lock.
var ErrMaintenanceBusy = errors.New("idem: another instance is running maintenance")

// RetentionError reports a retention that would delete markers while the
// broker may still redeliver their messages: those redeliveries would be
// applied a second time.
type RetentionError struct {
	// Retention is the age asked for; Horizon the redelivery horizon it
	// must not be shorter than.
	Retention, Horizon time.Duration
}

// Error implements error.
func (e *RetentionError) Error() string {
	return fmt.Sprintf("idem: retention %s is shorter than the redelivery horizon %s: a message redelivered after its marker is deleted would be applied again; keep markers at least as long as the broker may redeliver (Kafka topic retention, JetStream MaxAge, the longest dead-letter replay delay)",
		e.Retention, e.Horizon)
}

// Is makes errors.Is(err, ErrRetentionTooShort) true.
func (e *RetentionError) Is(target error) bool { return target == ErrRetentionTooShort }

// RetentionConfig configures a Pruner. The zero value keeps markers for
// DefaultRetention and deletes them in batches of DefaultPruneBatch.
type RetentionConfig struct {
	// Retention is how long a marker is kept after its message was
	// processed. Default DefaultRetention (7 days).
	Retention time.Duration
	// RedeliveryHorizon is the longest time after processing at which the
	// broker (or a replay) may still deliver a message again. A Retention
	// below it is refused with a *RetentionError. Default 0: not checked.
	RedeliveryHorizon time.Duration
	// BatchSize bounds the markers deleted per transaction, so no lock is
	// held for long. Default DefaultPruneBatch (5,000).
	BatchSize int
	// BatchTime sizes the marker batches by time: a run starts at
	// BatchSize; a batch that took longer than BatchTime halves the next
	// one (down to 100 markers), and one that took less than half of it
	// doubles the next (up to BatchSize). A store slowed by its disk or
	// by the processors beside it then keeps each delete short. Default
	// DefaultPruneBatchTime (40ms).
	BatchTime time.Duration
	// Pause is slept between batches to leave the store to the
	// processors. Default 0.
	Pause time.Duration
	// Logger receives a line per prune run and per failure. Default
	// slog.Default().
	Logger *slog.Logger
	// Now returns the current time. Default: the store's clock where the
	// driver reads it (driver.Clock: Postgres, which stamps the markers
	// with its own clock), else time.Now; tests set it.
	Now func() time.Time
}

// Pruner deletes markers older than the retention, in bounded batches, one
// instance at a time (a Postgres advisory lock; SQLite has a single writer
// anyway). It is safe for concurrent use.
type Pruner struct {
	drv   driver.MarkerPruner
	cfg   RetentionConfig
	clock driver.Clock // the store's, when its driver reads it and Now is not set
}

// PruneStats reports a prune run.
type PruneStats struct {
	// Cutoff is the processing time before which markers were deleted.
	Cutoff time.Time
	// Deleted is the number of markers deleted.
	Deleted int
	// OutboxDeleted is the number of published outbox rows deleted (when
	// the driver has an outbox).
	OutboxDeleted int
	// OutboxBatches is the number of outbox transactions used.
	OutboxBatches int
	// GapsDeleted is the number of the ordering guard's gap sightings
	// deleted (when the driver keeps them in a table): those whose
	// sequence was reached, and those first seen before the cutoff.
	GapsDeleted int
	// Batches is the number of transactions used.
	Batches int
	// Duration is the run's wall time; LongestBatch its slowest batch.
	Duration, LongestBatch time.Duration
}

// NewPruner returns a Pruner for drv, which must implement
// driver.MarkerPruner. The configuration is checked first: a retention
// shorter than the redelivery horizon is a *RetentionError, a negative
// setting ErrInvalidConfig.
func NewPruner(drv any, cfg *RetentionConfig) (*Pruner, error) {
	c := RetentionConfig{}
	if cfg != nil {
		c = *cfg
	}
	if c.Retention < 0 || c.RedeliveryHorizon < 0 || c.BatchSize < 0 || c.Pause < 0 || c.BatchTime < 0 {
		return nil, fmt.Errorf("%w: retention settings must not be negative", ErrInvalidConfig)
	}
	if c.Retention == 0 {
		c.Retention = DefaultRetention
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultPruneBatch
	}
	if c.BatchTime == 0 {
		c.BatchTime = DefaultPruneBatchTime
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	clock, _ := drv.(driver.Clock)
	if c.Now != nil {
		clock = nil // the caller's clock wins
	} else {
		c.Now = time.Now
	}
	if c.Retention < c.RedeliveryHorizon {
		return nil, &RetentionError{Retention: c.Retention, Horizon: c.RedeliveryHorizon}
	}
	mp, ok := drv.(driver.MarkerPruner)
	if !ok || mp == nil {
		return nil, fmt.Errorf("%w: driver %T does not implement driver.MarkerPruner", ErrInvalidConfig, drv)
	}
	return &Pruner{drv: mp, cfg: c, clock: clock}, nil
}

// Cutoff returns the processing time before which markers are deleted now,
// by this process's clock (Now). Prune and Prunable go by the store's
// clock where the driver reads it; PruneStats.Cutoff tells which cutoff a
// run used.
func (p *Pruner) Cutoff() time.Time { return p.cfg.Now().Add(-p.cfg.Retention) }

// cutoff is the cutoff of a run: by the store's clock when the driver
// reads it (the markers' times come from it, so a skewed host would
// delete early), else Cutoff.
func (p *Pruner) cutoff(ctx context.Context) (time.Time, error) {
	if p.clock == nil {
		return p.Cutoff(), nil
	}
	now, err := p.clock.Now(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("idem: read the store's clock: %w", err)
	}
	return now.Add(-p.cfg.Retention), nil
}

// PrunableStats reports what a Prune would delete now: a dry run.
type PrunableStats struct {
	// Cutoff is the processing time before which markers would be
	// deleted, by the clock a Prune goes by (the store's where the driver
	// reads it).
	Cutoff time.Time
	// Markers counts, per handler, the markers processed before Cutoff.
	Markers map[string]int64
	// Oldest is the oldest marker's processing time; zero when there is
	// none.
	Oldest time.Time
	// Outbox counts the published outbox rows a Prune would delete too
	// (when the driver has an outbox and counts them:
	// driver.OutboxPrunableCounter).
	Outbox int64
}

// Prunable counts, per handler, the markers a Prune now would delete, and
// reports the oldest marker's processing time: a dry run.
func (p *Pruner) Prunable(ctx context.Context) (PrunableStats, error) {
	cut, err := p.cutoff(ctx)
	if err != nil {
		return PrunableStats{}, err
	}
	counts, oldest, err := p.drv.CountPrunable(ctx, cut)
	if err != nil {
		return PrunableStats{}, fmt.Errorf("idem: count prunable markers: %w", err)
	}
	est := PrunableStats{Cutoff: cut, Markers: counts, Oldest: oldest}
	if oc, ok := p.drv.(driver.OutboxPrunableCounter); ok {
		if _, outbox := p.drv.(driver.OutboxRelayStore); outbox {
			if est.Outbox, err = oc.OutboxCountPrunable(ctx, cut); err != nil {
				return PrunableStats{}, fmt.Errorf("idem: count prunable outbox rows: %w", err)
			}
		}
	}
	return est, nil
}

// Prune deletes every marker older than the retention, batch by batch. It
// returns ErrMaintenanceBusy at once if another instance is pruning. On
// cancellation it stops after the current batch; what was deleted stays
// deleted.
func (p *Pruner) Prune(ctx context.Context) (PruneStats, error) {
	unlock, ok, err := p.drv.TryMaintenanceLock(ctx)
	if err != nil {
		return PruneStats{}, fmt.Errorf("idem: maintenance lock: %w", err)
	}
	if !ok {
		return PruneStats{}, ErrMaintenanceBusy
	}
	defer unlock()
	cut, err := p.cutoff(ctx)
	if err != nil {
		return PruneStats{}, err
	}
	st := PruneStats{Cutoff: cut}
	start := time.Now()
	params := &driver.PruneParams{Before: st.Cutoff, Limit: p.cfg.BatchSize}
	for {
		if err := ctx.Err(); err != nil {
			st.Duration = time.Since(start)
			return st, err
		}
		t0 := time.Now()
		res, err := p.drv.PruneMarkers(ctx, params)
		if err != nil {
			st.Duration = time.Since(start)
			return st, fmt.Errorf("idem: prune markers (batch %d): %w", st.Batches+1, err)
		}
		took := time.Since(t0)
		st.Batches++
		st.Deleted += res.Deleted
		st.LongestBatch = max(st.LongestBatch, took)
		if res.Done {
			break
		}
		params.Limit = p.nextBatch(params.Limit, took)
		params.After = res.Last
		if p.cfg.Pause > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(p.cfg.Pause):
			}
		}
	}
	if ob, ok := p.drv.(driver.OutboxRelayStore); ok {
		if err := p.pruneOutbox(ctx, ob, &st); err != nil {
			st.Duration = time.Since(start)
			return st, err
		}
	}
	if gp, ok := p.drv.(driver.GapPruner); ok {
		err := p.inBatches(ctx, &st, func() (int, error) {
			n, err := gp.PruneGaps(ctx, st.Cutoff, p.cfg.BatchSize)
			if err != nil {
				return 0, fmt.Errorf("idem: prune gap sightings: %w", err)
			}
			st.GapsDeleted += n
			return n, nil
		})
		if err != nil {
			st.Duration = time.Since(start)
			return st, err
		}
	}
	st.Duration = time.Since(start)
	p.cfg.Logger.Info("idem: pruned markers", slog.Int("deleted", st.Deleted), slog.Int("outbox_deleted", st.OutboxDeleted), slog.Int("gaps_deleted", st.GapsDeleted), slog.Int("batches", st.Batches),
		slog.Time("cutoff", st.Cutoff), slog.Duration("duration", st.Duration), slog.Duration("longest_batch", st.LongestBatch))
	return st, nil
}

// nextBatch returns the size of the marker batch after one of limit
// markers that took took: halved after a batch over BatchTime, doubled
// after one under half of it, within minPruneBatch and BatchSize.
func (p *Pruner) nextBatch(limit int, took time.Duration) int {
	switch {
	case took > p.cfg.BatchTime:
		return max(limit/2, min(p.cfg.BatchSize, minPruneBatch))
	case took < p.cfg.BatchTime/2:
		if limit > p.cfg.BatchSize/2 {
			return p.cfg.BatchSize // and 2*limit could overflow
		}
		return 2 * limit
	}
	return limit
}

// pruneOutbox deletes the outbox rows published before the cutoff, in
// batches like the markers. Pending rows are never deleted, whatever their
// age.
func (p *Pruner) pruneOutbox(ctx context.Context, ob driver.OutboxRelayStore, st *PruneStats) error {
	var after int64
	return p.inBatches(ctx, st, func() (int, error) {
		n, last, err := ob.OutboxPrune(ctx, st.Cutoff, after, p.cfg.BatchSize)
		if err != nil {
			return 0, fmt.Errorf("idem: prune outbox (batch %d): %w", st.OutboxBatches+1, err)
		}
		st.OutboxBatches++
		st.OutboxDeleted += n
		after = last
		return n, nil
	})
}

// inBatches runs batch until it deletes fewer than BatchSize rows or ctx
// ends, timing each run into st.LongestBatch and pausing Pause between
// them.
func (p *Pruner) inBatches(ctx context.Context, st *PruneStats, batch func() (int, error)) error {
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		t0 := time.Now()
		n, err := batch()
		if err != nil {
			return err
		}
		st.LongestBatch = max(st.LongestBatch, time.Since(t0))
		if n < p.cfg.BatchSize {
			return nil
		}
		if p.cfg.Pause > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(p.cfg.Pause):
			}
		}
	}
}

// Run prunes at once and then every interval until ctx is done, logging
// failures and going on; a run skipped because another instance holds the
// lock is not a failure. It returns ctx's error.
func (p *Pruner) Run(ctx context.Context, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("%w: prune interval %s must be positive", ErrInvalidConfig, interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := p.Prune(ctx); err != nil && !errors.Is(err, ErrMaintenanceBusy) && ctx.Err() == nil {
			p.cfg.Logger.Warn("idem: prune failed; retrying at the next interval", slog.Any("error", err))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
