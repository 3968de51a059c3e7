package sqlfilter

import (
	"slices"
	"testing"
	"time"

	"github.com/idemhq/idem/driver"
)

func TestJSONIDs(t *testing.T) {
	for ids, want := range map[*[]int64]string{{}: "[]", {7}: "[7]", {1, -2, 9223372036854775807}: "[1,-2,9223372036854775807]"} {
		if got := JSONIDs(*ids); got != want {
			t.Errorf("JSONIDs(%v) = %s, want %s", *ids, got, want)
		}
	}
}

func TestDeadLetters(t *testing.T) {
	if where, args := DeadLetters(nil, "IDS"); !slices.Equal(where, []string{"1 = 1"}) || len(args) != 0 {
		t.Fatalf("nil filter: %v %v", where, args)
	}
	since := time.UnixMicro(1_700_000_000_000_000)
	where, args := DeadLetters(&driver.DeadLetterFilter{Handler: "h", IDs: []int64{3}, Since: since, AfterID: 5}, "IDS")
	if want := []string{"1 = 1", "handler = ?", "IDS", "last_failed_at >= ?", "id > ?"}; !slices.Equal(where, want) {
		t.Fatalf("where %v, want %v", where, want)
	}
	if want := []any{"h", "[3]", since.UnixMicro(), int64(5)}; !slices.Equal(args, want) {
		t.Fatalf("args %v, want %v", args, want)
	}
	// An empty, non-nil ID list selects nothing.
	if where, _ := DeadLetters(&driver.DeadLetterFilter{IDs: []int64{}}, "IDS"); !slices.Contains(where, "1 = 0") {
		t.Fatalf("empty IDs: %v", where)
	}
}

func TestOutbox(t *testing.T) {
	f := driver.OutboxFilter{Destination: "d", IDs: []int64{1, 2}, State: driver.OutboxParked, AfterID: 9}
	where, args := OutboxScope(f, "IDS")
	if want := []string{"o.published_at IS NULL", "o.destination = ?", "o.IDS"}; !slices.Equal(where, want) {
		t.Fatalf("scope %v, want %v", where, want)
	}
	where, args = Outbox(f, where, args)
	if want := []any{"d", "[1,2]", int64(9)}; !slices.Equal(args, want) || where[len(where)-2] != OutboxState[driver.OutboxParked] {
		t.Fatalf("outbox %v %v", where, args)
	}
}
