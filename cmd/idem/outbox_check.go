package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// aggKey is one aggregate of one stream: the key of a versions row.
type aggKey struct{ stream, aggregate string }

// seqSeen is the highest sequence of an aggregate found in an issued
// message ID, and where.
type seqSeen struct {
	seq   int64
	where string
}

// reissue is an outbox row whose ID a consumer holds with another
// payload: the ID was issued twice.
type reissue struct {
	id, where string
}

// outboxCheck is what 'idem outbox check' found.
type outboxCheck struct {
	versions map[aggKey]int64
	streams  map[string]bool
	outbox   map[string][]byte // message ID → payload hash, of AddNext's rows
	highest  map[aggKey]seqSeen
	reissued []reissue
	ids      int // message IDs read outside the outbox
}

// parseOutboxID splits an ID made by outbox.MessageID into its stream,
// aggregate and sequence. ok is false for any other ID.
func parseOutboxID(id string) (k aggKey, seq int64, ok bool) {
	n, rest, found := strings.Cut(id, ":")
	if !found {
		return aggKey{}, 0, false
	}
	size, err := strconv.Atoi(n)
	if err != nil || size < 0 || size+1 > len(rest) || rest[size] != '-' {
		return aggKey{}, 0, false
	}
	stream, rest := rest[:size], rest[size+1:]
	i := strings.LastIndexByte(rest, '-')
	if i < 0 {
		return aggKey{}, 0, false
	}
	seq, err = strconv.ParseInt(rest[i+1:], 10, 64)
	if err != nil || seq < 1 || outbox.MessageID(stream, rest[:i], seq) != id {
		return aggKey{}, 0, false
	}
	return aggKey{stream, rest[:i]}, seq, true
}

// see records an issued message ID found in where, with its payload hash
// when known. IDs of streams the producer does not write are ignored.
func (c *outboxCheck) see(id string, hash []byte, where string) {
	k, seq, ok := parseOutboxID(id)
	if !ok || !c.streams[k.stream] {
		return
	}
	c.ids++
	if seq > c.highest[k].seq {
		c.highest[k] = seqSeen{seq, where}
	}
	if own, ok := c.outbox[id]; ok && hash != nil && !sameHash(own, hash) {
		c.reissued = append(c.reissued, reissue{id, where})
	}
}

// sameHash reports whether a marker's payload hash is the outbox row's:
// equal, or a prefix of at least 16 bytes (Postgres keeps 16 since
// migration 11).
func sameHash(own, stored []byte) bool {
	if len(stored) >= idem.MinStoredHash && len(stored) < len(own) {
		return bytes.Equal(own[:len(stored)], stored)
	}
	return bytes.Equal(own, stored)
}

// behind returns the aggregates whose versions row is below an issued
// sequence, sorted.
func (c *outboxCheck) behind() []aggKey {
	var ks []aggKey
	for k, s := range c.highest {
		if s.seq > c.versions[k] {
			ks = append(ks, k)
		}
	}
	slices.SortFunc(ks, func(a, b aggKey) int {
		return cmp2(a.stream, b.stream, a.aggregate, b.aggregate)
	})
	return ks
}

// cmp2 compares (a1, a2) with (b1, b2).
func cmp2(a1, b1, a2, b2 string) int {
	if c := strings.Compare(a1, b1); c != 0 {
		return c
	}
	return strings.Compare(a2, b2)
}

// eachRow runs q on s's SQL database and calls fn after scanning each row
// into dest.
func (s *store) eachRow(ctx context.Context, q string, fn func() error, dest ...any) error {
	switch s.kind {
	case kindSQLite:
		rows, err := s.sqliteDB.QueryContext(ctx, q)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			if err := rows.Scan(dest...); err != nil {
				return err
			}
			if err := fn(); err != nil {
				return err
			}
		}
		return rows.Err()
	case kindPostgres:
		rows, err := s.pgPool.Query(ctx, q)
		if err != nil {
			return err
		}
		_, err = pgx.ForEachRow(rows, dest, fn)
		return err
	}
	return fmt.Errorf("%s is no SQL store", s)
}

// readProducer reads the versions rows and the outbox's message IDs of the
// producer's store s.
func (c *outboxCheck) readProducer(ctx context.Context, s *store) error {
	var (
		stream, agg, id string
		seq             int64
		hash            []byte
	)
	err := s.eachRow(ctx, `SELECT stream, aggregate_id, version FROM `+s.table("versions"), func() error {
		c.versions[aggKey{stream, agg}] = seq
		c.streams[stream] = true
		return nil
	}, &stream, &agg, &seq)
	if err != nil {
		return fmt.Errorf("read the sequences of %s: %w", s, err)
	}
	err = s.eachRow(ctx, `SELECT message_id, payload_hash FROM `+s.table("outbox")+` WHERE seq > 0`, func() error {
		if k, _, ok := parseOutboxID(id); ok {
			c.streams[k.stream] = true
			c.outbox[id] = slices.Clone(hash)
		}
		return nil
	}, &id, &hash)
	if err != nil {
		return fmt.Errorf("read the outbox of %s: %w", s, err)
	}
	for id := range c.outbox {
		c.see(id, nil, "outbox")
	}
	c.ids = 0 // counts the IDs found outside the outbox
	return nil
}

// readConsumer reads the message IDs in the markers and dead letters of a
// consumer's store s.
func (c *outboxCheck) readConsumer(ctx context.Context, s *store) error {
	if s.kind == kindRedis {
		return c.readRedisConsumer(ctx, s)
	}
	var (
		id    string
		hash  []byte
		class string
	)
	markers, dls := "markers of "+s.String(), "dead letters of "+s.String()
	err := s.eachRow(ctx, `SELECT message_id, payload_hash FROM `+s.table("processed"), func() error {
		c.see(id, hash, markers)
		return nil
	}, &id, &hash)
	if err != nil {
		return fmt.Errorf("read the markers of %s: %w", s, err)
	}
	if s.kind == kindPostgres {
		// Atomic markers have their own table since migration 11, with
		// the message ID packed into a key.
		_, version, err := s.schemaVersion(ctx)
		if err != nil {
			return err
		}
		if version >= 11 {
			var key []byte
			err = s.eachRow(ctx, `SELECT message_key, payload_hash FROM `+s.table("markers"), func() error {
				c.see(postgres.MarkerMessageID(key), hash, markers)
				return nil
			}, &key, &hash)
			if err != nil {
				return fmt.Errorf("read the markers of %s: %w", s, err)
			}
		}
	}
	err = s.eachRow(ctx, `SELECT message_id, class FROM `+s.table("dead_letters")+` WHERE message_id <> ''`, func() error {
		c.see(id, nil, dls)
		if _, ok := c.outbox[id]; ok && class == "conflict" {
			c.reissued = append(c.reissued, reissue{id, dls})
		}
		return nil
	}, &id, &class)
	if err != nil {
		return fmt.Errorf("read the dead letters of %s: %w", s, err)
	}
	return nil
}

// readRedisConsumer reads the message IDs in the marker keys and the
// dead-letter index of a consumer's Redis store s. Payload hashes are not
// compared there.
func (c *outboxCheck) readRedisConsumer(ctx context.Context, s *store) error {
	prefix := s.opts.Prefix
	if prefix == "" {
		prefix = "idem:"
	}
	where := "markers of " + s.String()
	it := s.redisClient.Scan(ctx, 0, redisGlobEscape(prefix)+"m:*", 1000).Iterator()
	for it.Next(ctx) {
		if _, id, ok := strings.Cut(strings.TrimPrefix(it.Val(), prefix+"m:"), "|"); ok {
			c.see(id, nil, where)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read the markers of %s: %w", s, err)
	}
	keys, err := s.redisClient.HKeys(ctx, prefix+"dl:keys").Result()
	if err != nil {
		return fmt.Errorf("read the dead letters of %s: %w", s, err)
	}
	for _, k := range keys {
		// A field is "handler|message ID", then a NUL and the payload
		// hash since hashes are kept; one of a delivery that did not
		// decode has no ID before its NUL.
		_, id, ok := strings.Cut(k, "|")
		id, _, _ = strings.Cut(id, "\x00")
		if ok && id != "" {
			c.see(id, nil, "dead letters of "+s.String())
		}
	}
	return nil
}

// redisGlobEscape escapes the characters SCAN's MATCH pattern reads as
// wildcards, so that a key prefix holding one matches only itself.
func redisGlobEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\^`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// advance raises the versions rows of ks to the highest sequence issued,
// in one transaction. A row is never lowered, so a writer allocating
// meanwhile loses nothing.
func (c *outboxCheck) advance(ctx context.Context, s *store, ks []aggKey) error {
	t := s.table("versions")
	switch s.kind {
	case kindSQLite:
		tx, err := s.sqliteDB.BeginTx(ctx, nil)
		if err != nil {
			return fmt.Errorf("advance the sequences of %s: %w", s, err)
		}
		defer tx.Rollback()
		for _, k := range ks {
			if _, err := tx.ExecContext(ctx, `INSERT INTO `+t+` (stream, aggregate_id, version) VALUES (?, ?, ?)
ON CONFLICT (stream, aggregate_id) DO UPDATE SET version = max(version, excluded.version)`, k.stream, k.aggregate, c.highest[k].seq); err != nil {
				return fmt.Errorf("advance the sequence of %q/%q: %w", k.stream, k.aggregate, err)
			}
		}
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("advance the sequences of %s: %w", s, err)
		}
		return nil
	case kindPostgres:
		return pgx.BeginFunc(ctx, s.pgPool, func(tx pgx.Tx) error {
			for _, k := range ks {
				if _, err := tx.Exec(ctx, `INSERT INTO `+t+` AS v (stream, aggregate_id, version) VALUES ($1, $2, $3)
ON CONFLICT (stream, aggregate_id) DO UPDATE SET version = GREATEST(v.version, excluded.version)`, k.stream, k.aggregate, c.highest[k].seq); err != nil {
					return fmt.Errorf("advance the sequence of %q/%q: %w", k.stream, k.aggregate, err)
				}
			}
			return nil
		})
	}
	return fmt.Errorf("%s has no outbox", s)
}

// runOutboxCheck compares the sequences of the producer's store s with
// the message IDs issued from them: in its outbox, its own markers and
// dead letters, and those of the consumers' stores. With fix it advances
// the sequences that are behind.
func runOutboxCheck(ctx context.Context, w io.Writer, s *store, consumers []*store, fix bool) error {
	if s.kind == kindRedis {
		return fmt.Errorf("%s: Redis has no outbox; check the SQL store the outbox is in", s)
	}
	for _, st := range append([]*store{s}, consumers...) {
		if st.kind == kindMySQL {
			return fmt.Errorf("%s: outbox check reads SQLite, PostgreSQL and Redis stores; it does not read MySQL's tables", st)
		}
	}
	if n, version, err := s.schemaVersion(ctx); err != nil {
		return err
	} else if n == 0 {
		return s.errNoTables(ctx)
	} else if !s.hasOutbox(version) {
		return fmt.Errorf("%s has no outbox tables: run 'idem migrate' first", s)
	}
	c := &outboxCheck{versions: map[aggKey]int64{}, streams: map[string]bool{}, outbox: map[string][]byte{}, highest: map[aggKey]seqSeen{}}
	if err := c.readProducer(ctx, s); err != nil {
		return err
	}
	for _, cs := range append([]*store{s}, consumers...) {
		if err := c.readConsumer(ctx, cs); err != nil {
			return err
		}
	}
	fmt.Fprintf(w, "checked %s of %s against %s in the outbox and %d in markers and dead letters\n",
		plural(len(c.versions), "sequence"), plural(len(c.streams), "stream"), plural(len(c.outbox), "message ID"), c.ids)
	behind := c.behind()
	if len(behind) > 0 {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "STREAM\tAGGREGATE\tSEQUENCE\tISSUED UP TO\tFOUND IN")
		for _, k := range behind {
			// The aggregate comes from a consumer's message ID, so from the
			// broker: every stored string is escaped for the terminal.
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", termText(k.stream), termText(k.aggregate), c.versions[k], c.highest[k].seq, termText(c.highest[k].where))
		}
		tw.Flush()
	}
	if len(c.reissued) > 0 {
		slices.SortFunc(c.reissued, func(a, b reissue) int { return cmp2(a.id, b.id, a.where, b.where) })
		c.reissued = slices.Compact(c.reissued)
		var ids []string
		where := map[string][]string{}
		for _, r := range c.reissued {
			if len(where[r.id]) == 0 {
				ids = append(ids, r.id)
			}
			where[r.id] = append(where[r.id], r.where)
		}
		fmt.Fprintf(w, "%s in the outbox issued before with another payload (consumers dead-letter them as conflicts; see docs/outbox.md):\n", plural(len(ids), "message ID"))
		for _, id := range ids {
			fmt.Fprintf(w, "  %s  (%s)\n", termText(id), termText(strings.Join(where[id], "; ")))
		}
	}
	switch {
	case len(behind) == 0:
		fmt.Fprintln(w, "no sequence is behind an issued message ID")
		return nil
	case fix:
		if err := c.advance(ctx, s, behind); err != nil {
			return err
		}
		fmt.Fprintf(w, "advanced %s past the message IDs already issued\n", plural(len(behind), "sequence"))
		return nil
	}
	return fmt.Errorf("found %s behind the message IDs already issued (a restore from a backup?): the outbox would issue those IDs again with other payloads; stop the writers and run again with --fix",
		plural(len(behind), "sequence"))
}
