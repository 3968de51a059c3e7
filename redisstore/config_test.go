package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// TestProbeAsRestrictedUser: a user confined to commands that are neither
// admin nor dangerous (common on managed servers) runs idem; the probe
// that confirms an outage must answer for it too, or the first outage it
// confirmed would never end.
func TestProbeAsRestrictedUser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewRedisServer(t)
	admin := srv.Client(redis.Options{})
	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-@dangerous", "-@admin").Err(); err != nil {
		t.Fatal(err)
	}
	app := srv.Client(redis.Options{Username: "app", Password: "pw"})
	if err := app.Do(ctx, "ROLE").Err(); err == nil {
		t.Fatal("the restricted user may run ROLE: the test needs one that may not")
	}
	drv, err := redisstore.New(app, &redisstore.Config{Prefix: "t:"})
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("probe as a restricted user of a healthy server: %v", err)
	}
	// A user confined to the keys idem's processing writes, without the
	// probe's: the probe answers all the same.
	if err := admin.Do(ctx, "ACL", "SETUSER", "keys", "on", ">pw", "~t:m:*", "~t:n", "&*", "+@all", "-@dangerous", "-@admin").Err(); err != nil {
		t.Fatal(err)
	}
	keys, err := redisstore.New(srv.Client(redis.Options{Username: "keys", Password: "pw"}), &redisstore.Config{Prefix: "t:"})
	if err != nil {
		t.Fatal(err)
	}
	if err := keys.Probe(ctx); err != nil {
		t.Fatalf("probe as a user denied the probe's key: %v", err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(ctx context.Context, tx *redisstore.Tx, _ *idem.Message) error {
		return tx.Queue().Incr(ctx, "t:n").Err()
	}}
	if out, err := proc.Process(ctx, h, &idem.Message{ID: "a", Payload: []byte("x")}); err != nil || out != idem.Applied {
		t.Fatalf("process as the restricted user: %v, %v", out, err)
	}
}

// TestOutOfMemoryIsAnOutage: a server whose memory is full under
// noeviction (what docs/redis.md asks for) refuses writes with OOM, and
// one short of min-replicas-to-write with NOREPLICAS. That is the store
// being down: the marker insert (per message and in a
// batch) and a commit refused as its commands are queued return at once
// with an error Unavailable recognises, the probe fails until memory is
// freed, and then the messages apply.
func TestOutOfMemoryIsAnOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewRedisServer(t)
	admin := srv.Client(redis.Options{})
	client := srv.Client(redis.Options{})
	drv, err := redisstore.New(client, &redisstore.Config{Prefix: "t:"})
	if err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	full := func(on bool) {
		t.Helper()
		limit := "0"
		if on {
			limit = "1"
		}
		if err := admin.ConfigSet(ctx, "maxmemory", limit).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := admin.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	fill := false // the handler fills the memory before its write
	h := &idem.Handler[*redisstore.Tx]{Name: "h", ApplyBatch: func(ctx context.Context, tx *redisstore.Tx, msgs []*idem.Message) error {
		if fill {
			full(true)
		}
		for _, m := range msgs {
			if err := tx.Queue().SAdd(ctx, "t:applied", m.ID).Err(); err != nil {
				return err
			}
		}
		return nil
	}}
	msg := func(id string) *idem.Message { return &idem.Message{ID: id, Payload: []byte("x")} }
	refused := func(what string, f func(ctx context.Context) error) {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		start := time.Now()
		err := f(cctx)
		if err == nil || !drv.Unavailable(err) {
			t.Fatalf("%s on a full server: %v; want an error Unavailable recognises", what, err)
		}
		if took := time.Since(start); took > 3*time.Second {
			t.Fatalf("%s on a full server took %v: it waited rather than failing", what, took)
		}
		if err := drv.Probe(ctx); err == nil {
			t.Fatalf("%s: the probe passes on a full server", what)
		}
	}
	// Fewer replicas than min-replicas-to-write: writes refused too.
	if err := admin.ConfigSet(ctx, "min-replicas-to-write", "1").Err(); err != nil {
		t.Fatal(err)
	}
	refused("a message without its replicas", func(ctx context.Context) error { _, err := proc.Process(ctx, h, msg("a")); return err })
	if err := admin.ConfigSet(ctx, "min-replicas-to-write", "0").Err(); err != nil {
		t.Fatal(err)
	}
	full(true)
	refused("a message", func(ctx context.Context) error { _, err := proc.Process(ctx, h, msg("a")); return err })
	refused("a batch", func(ctx context.Context) error {
		_, err := proc.ProcessBatch(ctx, h, []*idem.Message{msg("b"), msg("c")})
		return err
	})
	full(false)
	fill = true
	refused("a commit", func(ctx context.Context) error { _, err := proc.Process(ctx, h, msg("d")); return err })
	fill = false
	full(false)
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("probe once memory is freed: %v", err)
	}
	if outs, err := proc.ProcessBatch(ctx, h, []*idem.Message{msg("a"), msg("b"), msg("c"), msg("d")}); err != nil {
		t.Fatalf("after the outage: %v, %v", outs, err)
	}
	got, err := admin.SMembers(ctx, "t:applied").Result()
	if err != nil || len(got) != 4 {
		t.Fatalf("applied %v (%v), want a, b, c and d", got, err)
	}
}

// TestMarkerKeyOfAnotherType: a key of another type where a marker goes
// (a prefix shared with other data) is reported at once, not waited on as
// if another transaction held the marker.
func TestMarkerKeyOfAnotherType(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, prefix := testenv.Redis(t)
	drv, err := redisstore.New(c, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.HSet(ctx, drv.MarkerKey("h", "a"), "f", "v").Err(); err != nil {
		t.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(context.Context, *redisstore.Tx, *idem.Message) error { return nil }}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = proc.Process(cctx, h, &idem.Message{ID: "a", Payload: []byte("x")})
	if err == nil || errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "not an idem marker") {
		t.Fatalf("a hash at the marker's key: %v; want an error saying it is not an idem marker", err)
	}
}

// TestMarkerKeyOfAnInvalidString: a string at a marker's key that is no
// marker's value (empty, a pending value without a token, text of
// another writer) is reported at once with ErrNotMarker naming the key,
// as a key of another type is, on every path that takes a marker: not
// waited on until the context ends, and not applied over. A marker that
// another delivery holds is still waited on.
func TestMarkerKeyOfAnInvalidString(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, prefix := testenv.Redis(t)
	applied := 0
	h := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(context.Context, *redisstore.Tx, *idem.Message) error {
		applied++
		return nil
	}}
	msg := func(id string) *idem.Message { return &idem.Message{ID: id, Payload: []byte("x")} }
	for _, writeOnly := range []bool{false, true} {
		drv, err := redisstore.New(c, &redisstore.Config{Prefix: prefix, WriteOnly: writeOnly})
		if err != nil {
			t.Fatal(err)
		}
		proc, err := idem.NewProcessor(drv, nil)
		if err != nil {
			t.Fatal(err)
		}
		paths := map[string]func(ctx context.Context, id string) error{
			"process": func(ctx context.Context, id string) error {
				_, err := proc.Process(ctx, h, msg(id))
				return err
			},
			// Two markers: taken by the batch's script, the bad one first
			// and last.
			"batch": func(ctx context.Context, id string) error {
				_, err := proc.ProcessBatch(ctx, h, []*idem.Message{msg(id), msg(id + "-0"), msg("0-" + id)})
				return err
			},
		}
		for path, run := range paths {
			for i, bad := range []string{"", "p:", "d", "text"} {
				id := fmt.Sprintf("%s-%v-%d", path, writeOnly, i)
				key := drv.MarkerKey("h", id)
				if err := c.Set(ctx, key, bad, 0).Err(); err != nil {
					t.Fatal(err)
				}
				before := applied
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				start := time.Now()
				err := run(cctx, id)
				cancel()
				if !errors.Is(err, redisstore.ErrNotMarker) || errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), key) {
					t.Errorf("%s (WriteOnly %v), %q at the marker's key: %v after %v; want ErrNotMarker naming the key", path, writeOnly, bad, err, time.Since(start).Round(time.Millisecond))
				}
				// (A write-only handler runs before the commit looks at the
				// marker; its writes are dropped.)
				if applied != before && (!writeOnly || path != "process") {
					t.Errorf("%s (WriteOnly %v), %q at the marker's key: the handler ran", path, writeOnly, bad)
				}
				if v, err := c.Get(ctx, key).Result(); err != nil || v != bad {
					t.Errorf("%s (WriteOnly %v): the key holds %q (%v) after, want %q left alone", path, writeOnly, v, err, bad)
				}
			}
		}
		// A key of another type: the same error. The markers the batch
		// took with it (IDs before and after) are let go of at once, not
		// left to expire: letting go skips the hash.
		for path, run := range paths {
			id := fmt.Sprintf("hash-%s-%v", path, writeOnly)
			key := drv.MarkerKey("h", id)
			if err := c.HSet(ctx, key, "f", "v").Err(); err != nil {
				t.Fatal(err)
			}
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := run(cctx, id)
			cancel()
			if !errors.Is(err, redisstore.ErrNotMarker) || !strings.Contains(err.Error(), key) {
				t.Errorf("%s (WriteOnly %v), a hash at the marker's key: %v; want ErrNotMarker naming the key", path, writeOnly, err)
			}
			for _, other := range []string{"0-" + id, id + "-0"} {
				if n, err := c.Exists(ctx, drv.MarkerKey("h", other)).Result(); err != nil || n != 0 {
					t.Errorf("%s (WriteOnly %v), a hash at the marker's key: the marker of %s is still held (%v)", path, writeOnly, other, err)
				}
			}
		}
		// Another delivery's hold is waited on: until the context ends
		// here, since it does not end.
		id := fmt.Sprint("held-", writeOnly)
		if err := c.Set(ctx, drv.MarkerKey("h", id), "p:0123456789abcdef0123456789abcdef", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
		for path, run := range paths {
			cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			err := run(cctx, id)
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s (WriteOnly %v), a marker another delivery holds: %v; want it waited on until the context ended", path, writeOnly, err)
			}
		}
	}
}

// TestMigrateRefusesEviction: on a server that may evict markers (a
// maxmemory with an allkeys-* policy, or volatile-* when markers expire)
// Migrate fails with ErrInvalidConfig, since an evicted marker is a
// message applied twice; settings that evict no marker, the opt-out and a
// client not allowed to read the configuration pass. The test runs its
// own server, whose configuration it changes.
func TestMigrateRefusesEviction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewRedisServer(t)
	admin := srv.Client(redis.Options{})
	for _, c := range []struct {
		maxmemory, policy string
		cfg               redisstore.Config
		refused           bool
	}{
		{"100mb", "allkeys-lru", redisstore.Config{}, true},
		{"100mb", "allkeys-random", redisstore.Config{}, true},
		{"100mb", "volatile-lru", redisstore.Config{MarkerTTL: time.Hour}, true},
		{"100mb", "volatile-ttl", redisstore.Config{}, false},
		{"100mb", "noeviction", redisstore.Config{MarkerTTL: time.Hour}, false},
		{"0", "allkeys-lru", redisstore.Config{}, false},
		{"100mb", "allkeys-lru", redisstore.Config{AllowEviction: true}, false},
	} {
		if err := admin.ConfigSet(ctx, "maxmemory", c.maxmemory).Err(); err != nil {
			t.Fatal(err)
		}
		if err := admin.ConfigSet(ctx, "maxmemory-policy", c.policy).Err(); err != nil {
			t.Fatal(err)
		}
		drv, err := redisstore.New(admin, &c.cfg)
		if err != nil {
			t.Fatal(err)
		}
		err = drv.Migrate(ctx)
		if refused := errors.Is(err, idem.ErrInvalidConfig); refused != c.refused || (err != nil && !refused) {
			t.Errorf("maxmemory %s, policy %s, %+v: Migrate %v; want refused %v", c.maxmemory, c.policy, c.cfg, err, c.refused)
		}
	}
	// A user who may not run CONFIG (as on managed services) is not
	// checked, and not refused either.
	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-config").Err(); err != nil {
		t.Fatal(err)
	}
	app := srv.Client(redis.Options{Username: "app", Password: "pw"})
	if err := app.ConfigGet(ctx, "maxmemory").Err(); err == nil {
		t.Fatal("the restricted user may read the configuration: the test needs one that may not")
	}
	drv, err := redisstore.New(app, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatalf("Migrate as a user without CONFIG: %v", err)
	}
}

// TestHandSetKeysWithoutExpiryAreNotWaitedOn: every hold and lock the
// driver takes expires, so a pending marker value or a lock key without
// an expiry (set by hand, or by another writer sharing the prefix), or a
// sequence or lock key of another type, is reported at once with
// ErrNotMarker naming the key, on every path, instead of being waited on
// until the context ends (forever, under a consumer without a deadline).
func TestHandSetKeysWithoutExpiryAreNotWaitedOn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, prefix := testenv.Redis(t)
	applied := 0
	h := &idem.Handler[*redisstore.Tx]{Name: "h", Apply: func(context.Context, *redisstore.Tx, *idem.Message) error {
		applied++
		return nil
	}}
	check := func(what, key string, run func(context.Context) error) {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		start := time.Now()
		err := run(cctx)
		if !errors.Is(err, redisstore.ErrNotMarker) || !strings.Contains(err.Error(), key) {
			t.Errorf("%s: %v after %v; want ErrNotMarker naming %q", what, err, time.Since(start).Round(time.Millisecond), key)
		}
	}
	for _, writeOnly := range []bool{false, true} {
		drv, err := redisstore.New(c, &redisstore.Config{Prefix: prefix, WriteOnly: writeOnly})
		if err != nil {
			t.Fatal(err)
		}
		proc, err := idem.NewProcessor(drv, nil)
		if err != nil {
			t.Fatal(err)
		}
		id := fmt.Sprintf("persisted-hold-%v", writeOnly)
		key := drv.MarkerKey("h", id)
		if err := c.Set(ctx, key, "p:0123456789abcdef", 0).Err(); err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprintf("a pending value without an expiry (WriteOnly %v)", writeOnly), key, func(ctx context.Context) error {
			_, err := proc.Process(ctx, h, &idem.Message{ID: id, Payload: []byte("x")})
			return err
		})
		if v, err := c.Get(ctx, key).Result(); err != nil || v != "p:0123456789abcdef" {
			t.Errorf("the key was not left alone: %q, %v", v, err)
		}
	}
	if applied > 1 { // a write-only handler runs before its commit looks
		t.Errorf("applied %d times", applied)
	}
	drv, err := redisstore.New(c, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	seq := func(agg string) func(context.Context) error {
		return func(ctx context.Context) error {
			tx, err := drv.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = drv.Rollback(ctx, tx) }()
			_, err = drv.SequenceAdvance(ctx, tx, &driver.SequenceAdvanceParams{Handler: "h", AggregateID: agg, Seq: 1})
			return err
		}
	}
	c.Set(ctx, prefix+"ls:h|lock-string", "junk", 0)
	check("a sequence lock without an expiry", prefix+"ls:h|lock-string", seq("lock-string"))
	c.HSet(ctx, prefix+"ls:h|lock-hash", "f", "v")
	check("a sequence lock of another type", prefix+"ls:h|lock-hash", seq("lock-hash"))
	c.HSet(ctx, prefix+"s:h|seq-hash", "f", "v")
	check("a sequence of another type", prefix+"s:h|seq-hash", seq("seq-hash"))
	if v, err := c.Get(ctx, prefix+"ls:h|lock-string").Result(); err != nil || v != "junk" {
		t.Errorf("the lock key was not left alone: %q, %v", v, err)
	}
}
