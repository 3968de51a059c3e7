package main

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
)

// TestTermText pins the escapes: control, format and separator runes and
// bytes that are not UTF-8 are written as Go escapes; the rest is kept.
func TestTermText(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"evt-1":                           "evt-1",
		"naïve 日本 \\x1b":                  "naïve 日本 \\x1b",
		"\x1b[2J\x1b[HAll clear":          `\x1b[2J\x1b[HAll clear`,
		"a\nb\tc\rd\x00e\x7f":             `a\x0ab\x09c\x0dd\x00e\x7f`,
		"\u0085\u009b31m":                 `\u0085\u009b31m`,
		"abc\u202egpj.exe":                `abc\u202egpj.exe`,
		"\u2066x\u2069\u200e\u200f\ufeff": `\u2066x\u2069\u200e\u200f\ufeff`,
		"\u2028\u2029\u00ad\u200d":        `\u2028\u2029\u00ad\u200d`,
		"\xff\xfe ok \xe2\x80":            `\xff\xfe ok \xe2\x80`,
		"\U000e0001tag":                   `\U000e0001tag`,
		"\ufffd stays":                    "\ufffd stays",
	} {
		if got := termText(in); got != want {
			t.Errorf("termText(%q) = %q, want %q", in, got, want)
		}
	}
	if got, want := termBlock("line 1\n\tat x\x1b[2J"), "line 1\n\tat x\\x1b[2J"; got != want {
		t.Errorf("termBlock = %q, want %q", got, want)
	}
}

// FuzzTermText: whatever the input, termText's output is UTF-8 without a
// single control, format or separator rune, and termBlock's adds only
// newlines and tabs; input that needs no escape comes back unchanged.
//
//	go test ./cmd/idem -run '^$' -fuzz FuzzTermText -fuzztime 30s
func FuzzTermText(f *testing.F) {
	for _, s := range []string{"", "evt-1", "\x1b[2J\x1b[HAll clear", "abc\u202egpj", "\xff\xc3", "a\nb\tc", "\u0085\u061c\u2066\U000e0001", "日本\u200d"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, block := range []bool{false, true} {
			out := termEscape(s, block)
			if !utf8.ValidString(out) {
				t.Fatalf("termEscape(%q, %v) = %q: not UTF-8", s, block, out)
			}
			for _, r := range out {
				if block && (r == '\n' || r == '\t') {
					continue
				}
				if unicode.IsControl(r) || unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp) {
					t.Fatalf("termEscape(%q, %v) = %q: holds %U", s, block, out, r)
				}
			}
			clean := utf8.ValidString(s) && !strings.ContainsFunc(s, func(r rune) bool {
				return !(block && (r == '\n' || r == '\t')) && (unicode.IsControl(r) || unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp))
			})
			if clean != (out == s) {
				t.Fatalf("termEscape(%q, %v) = %q: changed %v, want %v", s, block, out, out != s, !clean)
			}
		}
	})
}

// TestHumanOutputEscapesStoredStrings writes hostile strings where broker
// data lands (message ID, source, error, handler, outbox error) and checks
// that no human output of dlq list/show, stats, cleanup and outbox stats
// carries an ESC or a bidi override, while --json keeps them exact.
func TestHumanOutputEscapesStoredStrings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "hostile.db")
	db, drv := testenv.SQLite(t, path, nil)
	const (
		id      = "m-1\x1b[2J\x1b[H\x1b[32mAll clear\x1b[0m"
		handler = "bal\u202eances"
		source  = "nats\u009b2J"
		errText = "boom\r\x1b]0;pwned\x07\nline 2"
	)
	if _, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: handler, MessageID: id, Source: source, Error: errText, Class: idem.DeadLetterPermanent, Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	old := time.Now().Add(-48 * time.Hour).UnixMicro()
	if _, err := db.ExecContext(ctx, `INSERT INTO idem_processed (handler, message_id, payload_hash, processed_at) VALUES (?, ?, x'00', ?)`, handler, id, old); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem_outbox (destination, message_id, ordering_key, payload, payload_hash, created_at, attempts, last_error)
		VALUES ('d', ?, 'k', x'00', x'00', ?, 1, ?)`, id, old, errText); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{dsnEnv: path}
	for _, args := range [][]string{
		{"dlq", "list"}, {"dlq", "show", "1"}, {"stats"}, {"cleanup", "--dry-run", "--retention", "1h"}, {"outbox", "stats"},
	} {
		code, out, errOut := runCLIEnv(t, env, args...)
		if code != exitOK {
			t.Fatalf("idem %s: exit %d\n%s%s", strings.Join(args, " "), code, out, errOut)
		}
		if i := strings.IndexFunc(out+errOut, func(r rune) bool {
			return r != '\n' && r != '\t' && (unicode.IsControl(r) || unicode.Is(unicode.Cf, r))
		}); i >= 0 {
			t.Errorf("idem %s prints a control or format character:\n%q", strings.Join(args, " "), out+errOut)
		}
		if args[0] != "cleanup" && !strings.Contains(out, `\x1b`) && !strings.Contains(out, `\u202e`) {
			t.Errorf("idem %s: the hostile string is not shown escaped:\n%s", strings.Join(args, " "), out)
		}
	}
	code, out, errOut := runCLIEnv(t, env, "dlq", "show", "1", "--json")
	if code != exitOK {
		t.Fatalf("dlq show --json: exit %d: %s", code, errOut)
	}
	var j struct {
		Handler   string `json:"handler"`
		MessageID string `json:"message_id"`
		Source    string `json:"source"`
		Error     string `json:"error"`
	}
	if err := json.Unmarshal([]byte(out), &j); err != nil {
		t.Fatal(err)
	}
	if j.Handler != handler || j.MessageID != id || j.Source != source || j.Error != errText {
		t.Errorf("dlq show --json changed the stored strings: %+v", j)
	}
}
