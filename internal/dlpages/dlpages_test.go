package dlpages_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/dlpages"
	"github.com/idemhq/idem/internal/testenv"
)

// Each hands over the selection in ID order, a page at a time, the last
// one short, and stops at Limit.
func TestEach(t *testing.T) {
	ctx := context.Background()
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	for i := range 5 {
		if _, err := drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "h", MessageID: fmt.Sprintf("m-%d", i), Raw: []byte("x"),
			Error: "bad", Class: "permanent", Fingerprint: "fp", Attempts: 1}); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		limit int
		want  string
	}{{0, "[m-0 m-1] [m-2 m-3] [m-4] "}, {3, "[m-0 m-1] [m-2] "}, {4, "[m-0 m-1] [m-2 m-3] "}} {
		got := ""
		err := dlpages.Each(ctx, drv, &driver.DeadLetterFilter{Handler: "h", Limit: tc.limit}, 2, func(page []driver.DeadLetter) error {
			var ids []string
			for _, d := range page {
				if d.Raw != nil {
					t.Errorf("%s: a summary carries its payload", d.MessageID)
				}
				ids = append(ids, d.MessageID)
			}
			got += fmt.Sprint(ids) + " "
			return nil
		})
		if err != nil || got != tc.want {
			t.Errorf("Limit %d: pages %q, %v; want %q", tc.limit, got, err, tc.want)
		}
	}
}
