package idem_test

import (
	"context"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
)

// stuckImporter breaks the MarkerImporter contract the way a driver that
// reads its cursor back as another value would: every page is the same.
type stuckImporter struct{ inserted int }

func (*stuckImporter) ImportIDs(context.Context, *driver.ImportSource, string, int) ([]string, error) {
	return []string{"a", "b"}, nil
}

func (s *stuckImporter) InsertImportedMarkers(_ context.Context, _ string, ids []string) (int64, error) {
	s.inserted += len(ids)
	return int64(len(ids)), nil
}

// TestImportStopsOnAStuckCursor: a page that ends where the previous one
// did is an error, not an endless loop or an early success.
func TestImportStopsOnAStuckCursor(t *testing.T) {
	imp := &stuckImporter{}
	res, err := idem.ImportMarkers(context.Background(), imp, "h", &driver.ImportSource{Table: "t", Column: "c"}, &idem.ImportOptions{Batch: 2})
	if err == nil || !strings.Contains(err.Error(), `the page after ID "b" ends with it again`) {
		t.Fatalf("import: %+v, %v; want the stuck-cursor error", res, err)
	}
	if res.Read != 4 || imp.inserted != 4 {
		t.Fatalf("read %d, inserted %d before stopping; want the two pages", res.Read, imp.inserted)
	}
}
