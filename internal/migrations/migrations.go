// Package migrations loads a driver's embedded, versioned SQL migrations.
//
// A migration file is named NNN_description.sql. Table names inside are
// written as {{name}} (for example {{processed}}) and replaced with the
// driver's quoted, prefixed identifiers, so SQL never interpolates raw
// configuration.
package migrations

import (
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
)

// Migration is one versioned schema step.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Load reads every *.sql file in dir of fsys, substitutes the {{name}}
// placeholders with r and returns the migrations by ascending version.
func Load(fsys fs.FS, dir string, r *strings.Replacer) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, dir)
	if err != nil {
		return nil, err
	}
	var out []Migration
	seen := map[int]string{}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		num, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration %q: name must start with a positive version number and _", e.Name())
		}
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migrations %q and %q share version %d", prev, e.Name(), v)
		}
		seen[v] = e.Name()
		b, err := fs.ReadFile(fsys, path.Join(dir, e.Name()))
		if err != nil {
			return nil, err
		}
		sql := r.Replace(string(b))
		if i := strings.Index(sql, "{{"); i >= 0 {
			return nil, fmt.Errorf("migration %q: unknown placeholder near %q", e.Name(), sql[i:min(len(sql), i+30)])
		}
		out = append(out, Migration{Version: v, Name: e.Name(), SQL: sql})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}
