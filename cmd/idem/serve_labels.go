package main

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

// A label value must be UTF-8, and the store's handler names need not be:
// the API refuses such names, but a row written outside it (raw SQL, an
// old tool) can hold any bytes. One such row must not fail the scrape and
// take idem_store_up and every other metric with it, so handler names go
// through metricLabel and metrics are built by constMetric, which never
// panics.

// metricLabel returns s as a valid label value: s itself when it is UTF-8,
// else s with every byte that is not part of a UTF-8 sequence written as
// \xNN (the same escape the terminal output uses), so the same stored name
// always gets the same label.
func metricLabel(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size <= 1 {
			fmt.Fprintf(&b, `\x%02x`, s[i])
		} else {
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// handlerLabels returns the label value of each handler of list, in order.
// Two names that escape alike (a name that is not UTF-8 and one spelling
// its escape) would collect the same series twice, which fails a scrape:
// the later one gets a "#2" suffix (then "#3"…), so every label is unique.
func handlerLabels(list []*handlerStats) []string {
	labels := make([]string, len(list))
	seen := make(map[string]bool, len(list))
	for i, st := range list {
		l := metricLabel(st.Handler)
		for n := 2; seen[l]; n++ {
			l = fmt.Sprintf("%s#%d", metricLabel(st.Handler), n)
		}
		seen[l] = true
		labels[i] = l
	}
	return labels
}

// constMetric is prometheus.MustNewConstMetric without the panic: a value
// it cannot build (a label that is not UTF-8 despite metricLabel, a wrong
// label count) becomes an invalid metric, which fails that series alone
// under promhttp.ContinueOnError instead of the process's scrape.
func constMetric(desc *prometheus.Desc, typ prometheus.ValueType, v float64, labels ...string) prometheus.Metric {
	m, err := prometheus.NewConstMetric(desc, typ, v, labels...)
	if err != nil {
		return prometheus.NewInvalidMetric(desc, fmt.Errorf("build metric: %w", err))
	}
	return m
}
