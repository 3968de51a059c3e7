package idemtest

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// CheckImport checks idem.ImportMarkers against s, whose Driver must
// implement driver.MarkerImporter: fill writes the given values into the
// hand-rolled table src names (creating it). 2,500 valid IDs and one value
// too long to be an ID are imported in batches of 1,000; then every
// imported ID, with any payload, is a Duplicate whose handler never runs,
// a new ID applies, and a second import finds every marker in place.
func CheckImport[TTx any](t *testing.T, s *Store[TTx], src *driver.ImportSource, fill func(ctx context.Context, values []string) error) {
	t.Helper()
	ctx := context.Background()
	imp, ok := s.Driver.(driver.MarkerImporter)
	if !ok {
		t.Fatalf("%T does not implement driver.MarkerImporter", s.Driver)
	}
	const n = 2500
	values := make([]string, 0, n+1)
	for i := range n {
		values = append(values, fmt.Sprintf("old-%05d", i))
	}
	long := strings.Repeat("x", 300)
	values = append(values, long)
	if err := fill(ctx, values); err != nil {
		t.Fatal(err)
	}

	var invalid []string
	res, err := idem.ImportMarkers(ctx, imp, "balances", src, &idem.ImportOptions{Batch: 1000, Invalid: func(v string, err error) {
		if err == nil {
			t.Errorf("Invalid(%q) called without an error", v)
		}
		invalid = append(invalid, v)
	}})
	if err != nil {
		t.Fatal(err)
	}
	if want := (idem.ImportResult{Read: n + 1, Imported: n, Invalid: 1}); res != want {
		t.Fatalf("import: %+v, want %+v", res, want)
	}
	if len(invalid) != 1 || invalid[0] != long {
		t.Fatalf("invalid values reported: %d, want the 300-byte one", len(invalid))
	}

	proc, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls sync.Map
	h := CreditHandler(s, "balances", &calls)
	for _, id := range []string{"old-00000", "old-01234", "old-02499"} {
		out, err := proc.Process(ctx, h, Event{ID: id, Account: "acct-1", Amount: 5}.Message())
		if err != nil || out != idem.Duplicate {
			t.Errorf("imported %s redelivered: %v, %v; want duplicate without error", id, out, err)
		}
	}
	msgs := []*idem.Message{
		Event{ID: "old-00001", Account: "acct-1", Amount: 7}.Message(),
		Event{ID: "new-1", Account: "acct-1", Amount: 11}.Message(),
	}
	outs, err := proc.ProcessBatch(ctx, h, msgs)
	if err != nil || len(outs) != 2 || outs[0] != idem.Duplicate || outs[1] != idem.Applied {
		t.Errorf("batch of an imported and a new ID: %v, %v; want [duplicate applied]", outs, err)
	}
	calls.Range(func(k, _ any) bool {
		if id := k.(string); id != "new-1" {
			t.Errorf("handler ran for imported %s", id)
		}
		return true
	})
	bal, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if bal["acct-1"] != 11 {
		t.Errorf("balance %d, want 11 (the new message alone)", bal["acct-1"])
	}

	again, err := idem.ImportMarkers(ctx, imp, "balances", src, &idem.ImportOptions{Batch: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if want := (idem.ImportResult{Read: n + 1, Existing: n, Invalid: 1}); again != want {
		t.Errorf("second import: %+v, want %+v", again, want)
	}
}
