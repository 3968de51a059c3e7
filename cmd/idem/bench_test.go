package main

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
)

// TestBenchJSONReportsRatios runs a very short benchmark on a temporary
// SQLite file and checks the JSON figures are consistent: the ratio is the
// median of the rounds' idem/plain ratios.
func TestBenchJSONReportsRatios(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "bench", "--json", "--cases", "per-message,batch-100,batch-1000-per-event", "--rounds", "3", "--round", "100ms", "--workers", "2")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var results []benchResult
	if err := json.Unmarshal([]byte(out), &results); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	if len(results) != 3 || results[0].Case != "per-message" || results[1].BatchSize != 100 ||
		results[2].Case != "batch-1000-per-event" || results[2].BatchSize != 1000 {
		t.Fatalf("results %+v, want per-message, batch-100, batch-1000-per-event", results)
	}
	for _, r := range results {
		if r.Store != "sqlite" || r.Plain <= 0 || r.Idem <= 0 {
			t.Errorf("%s: %+v, want positive rates on sqlite", r.Case, r)
		}
		if len(r.PlainRuns) != 3 || len(r.IdemRuns) != 3 {
			t.Fatalf("%s: %d plain and %d idem rounds, want 3 each", r.Case, len(r.PlainRuns), len(r.IdemRuns))
		}
		pairs := make([]float64, 3)
		for i := range pairs {
			pairs[i] = r.IdemRuns[i] / r.PlainRuns[i]
		}
		if len(r.RoundRatios) != 3 || math.Abs(r.RoundRatios[2]-pairs[2]) > 1e-9 {
			t.Errorf("%s: round ratios %v, want the rounds' idem/plain %v", r.Case, r.RoundRatios, pairs)
		}
		slices.Sort(pairs)
		if got := pairs[1]; got-r.Ratio > 1e-9 || r.Ratio-got > 1e-9 {
			t.Errorf("%s: ratio %v, want the median round ratio %v (rounds %v)", r.Case, r.Ratio, got, pairs)
		}
	}
}

// TestBenchRejectsUnknownCase checks a bad --cases value is a usage error.
func TestBenchRejectsUnknownCase(t *testing.T) {
	t.Parallel()
	code, _, errOut := runCLI(t, "bench", "--cases", "batch-7")
	if code != exitUsage || !strings.Contains(errOut, `unknown case "batch-7"`) {
		t.Fatalf("exit %d, stderr %q; want a usage error naming the case", code, errOut)
	}
}

// TestBenchRoundRatios checks the spread printed beside the median: the
// lowest and highest of the rounds' idem/plain ratios.
func TestBenchRoundRatios(t *testing.T) {
	r := benchResult{RoundRatios: []float64{0.8, 0.9, 0.75}}
	if lo, hi := r.roundRatios(); lo != 0.75 || hi != 0.9 {
		t.Errorf("roundRatios = %v, %v; want 0.75, 0.9", lo, hi)
	}
}

// TestBenchTablePrintsRoundSpread runs a very short benchmark and checks
// the table has the rounds column with a low-high range, aligned.
func TestBenchTablePrintsRoundSpread(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "bench", "--cases", "per-message", "--rounds", "2", "--round", "100ms", "--workers", "2")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) != 2 || !strings.HasSuffix(strings.Join(strings.Fields(lines[0]), " "), "ratio rounds") {
		t.Fatalf("table:\n%s\nwant a header ending in ratio, rounds and one row", out)
	}
	f := strings.Fields(lines[1])
	var lo, hi float64
	if _, err := fmt.Sscanf(f[len(f)-1], "%f-%f", &lo, &hi); err != nil || lo <= 0 || lo > hi {
		t.Errorf("rounds cell %q: want low-high with 0 < low <= high (%v)", f[len(f)-1], err)
	}
	if len(lines[0]) != len(lines[1]) {
		t.Errorf("header and row widths differ, columns misaligned:\n%s", out)
	}
}

// TestBenchSkipsCasesOfAnotherStore checks that a Redis-only case asked of
// SQLite is skipped with a note, and the others still run.
func TestBenchSkipsCasesOfAnotherStore(t *testing.T) {
	t.Parallel()
	code, out, errOut := runCLI(t, "bench", "--cases", "per-message-write-only,per-message", "--rounds", "1", "--round", "50ms", "--workers", "2")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if !strings.Contains(errOut, "per-message-write-only runs on redis only; skipped") {
		t.Errorf("stderr %q: want the skip noted", errOut)
	}
	if strings.Contains(out, "write-only") || !strings.Contains(out, "per-message") {
		t.Errorf("table:\n%s\nwant per-message only", out)
	}
}
