package main

import (
	"context"
	"strings"
	"testing"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/redisstore"
)

// TestDLQOnRedis lists, discards and replays dead letters kept by
// redisstore, and checks that the SQL-only commands refuse a Redis DSN.
func TestDLQOnRedis(t *testing.T) {
	ctx := context.Background()
	client, prefix := testenv.Redis(t)
	drv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"m-1", "m-2"} {
		if _, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "balances", MessageID: id, Error: "boom " + id, Class: "permanent", Attempts: 1}); err != nil {
			t.Fatal(err)
		}
	}
	o := client.Options()
	env := map[string]string{dsnEnv: "redis://" + o.Addr + "/0"}
	// run runs idem with the command's words, --prefix, then rest.
	run := func(want int, words []string, rest ...string) string {
		t.Helper()
		args := append(append(append([]string{}, words...), "--prefix", prefix), rest...)
		code, out, errOut := runCLIEnv(t, env, args...)
		if code != want {
			t.Fatalf("idem %s: exit %d, want %d\n%s%s", strings.Join(args, " "), code, want, out, errOut)
		}
		return out + errOut
	}
	if out := run(exitOK, []string{"migrate"}); !strings.Contains(out, "needs no migration") {
		t.Errorf("migrate: %q", out)
	}
	if out := run(exitOK, []string{"dlq", "list"}); !strings.Contains(out, "boom m-1") || !strings.Contains(out, "boom m-2") {
		t.Errorf("dlq list:\n%s", out)
	}
	run(exitOK, []string{"dlq", "discard"}, "--actor", "alice", "1")
	run(exitOK, []string{"dlq", "replay"}, "--actor", "bob", "2")
	dls, err := drv.DeadLetterList(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 2 || dls[0].State != driver.DeadLetterDiscarded || dls[1].State != driver.DeadLetterReplayRequested {
		t.Fatalf("dead letters after discard and replay: %+v", dls)
	}
	if out := run(exitOK, []string{"dlq", "show"}, "1"); !strings.Contains(out, "alice") || !strings.Contains(out, "discarded") {
		t.Errorf("dlq show 1 lacks the discard in its history:\n%s", out)
	}
	for _, cmd := range [][]string{{"stats"}, {"cleanup"}, {"outbox", "stats"}, {"outbox", "notify", "on"}, {"serve"}} {
		// The refusal names the command given (outbox notify said "outbox
		// stats").
		if out := run(exitUsage, cmd); !strings.Contains(out, "SQL stores") || !strings.Contains(out, strings.Join(cmd[:min(len(cmd), 2)], " ")+" reads") {
			t.Errorf("idem %s on Redis: %q", strings.Join(cmd, " "), out)
		}
	}
}
