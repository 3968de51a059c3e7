package errtext_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/idemhq/idem/internal/errtext"
)

func TestQuote(t *testing.T) {
	if got := errtext.Quote("a\x00b"); got != `"a\x00b"` {
		t.Errorf("Quote short: %s", got)
	}
	long := strings.Repeat("x", 1<<20)
	got := errtext.Quote([]byte(long))
	if len(got) > errtext.Max+40 || !strings.HasSuffix(got, "(1048576 bytes)") {
		t.Errorf("Quote of 1 MiB: %d bytes, %q…", len(got), got[:min(len(got), 120)])
	}
}

func TestStorable(t *testing.T) {
	if got := errtext.Storable("a\x00b\xffc", 100); got != "a\uFFFDb\uFFFDc" {
		t.Errorf("Storable of NUL and a bad byte: %q", got)
	}
	long := strings.Repeat("é", 100) // 2 bytes each
	got := errtext.Storable(long, 11)
	if got != strings.Repeat("é", 5)+"…" {
		t.Errorf("Storable cut at 11 bytes: %q, want five runes and an ellipsis", got)
	}
}

func ExampleQuote() {
	fmt.Println(errtext.Quote("acct-7"))
	fmt.Println(errtext.Quote(strings.Repeat("ab", 50)))
	// Output:
	// "acct-7"
	// "abababababababababababababababababababababababababababababababababababababababab"… (100 bytes)
}
