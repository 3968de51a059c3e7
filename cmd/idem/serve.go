package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"html/template"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemhq/idem/driver"
)

// serveHealthTimeout bounds /healthz's query.
const serveHealthTimeout = 5 * time.Second

// servePageDeadLetters is how many parked dead letters the page lists.
const servePageDeadLetters = 50

func serveCommand() *command {
	return &command{
		name:     "serve",
		synopsis: "--dsn DSN [--schema S] [--prefix P] [--addr HOST:PORT] [--allow-host NAME] [--refresh D] [--read-timeout D]",
		summary:  "serve the store's state as Prometheus metrics and a read-only admin page",
		help: `Serve runs an HTTP server over idem's tables:

  /metrics   Prometheus metrics read from the store at most once per
             --refresh (counting markers scans their table):
             idem_store_up, and per handler idem_store_markers,
             idem_store_duplicates_total, idem_store_stale_total,
             idem_store_leases{status}, idem_store_dead_letters{state},
             idem_store_conflicts, idem_store_oldest_marker_timestamp_seconds;
             the outbox's idem_outbox_pending, idem_outbox_failing,
             idem_outbox_published and idem_outbox_oldest_pending_age_seconds;
             and the Go runtime's metrics of this process
  /          a read-only page: the same per-handler counts as 'idem stats'
             (the reading /metrics uses, at most --refresh old), the
             outbox, and the oldest parked dead letters
  /healthz   200 when the store answers and holds idem's tables, 503
             otherwise

The live counters of your consumers (outcomes, errors, verdicts, durations)
come from the metrics package's hook in your own processes; serve adds what
only the store knows. The page changes nothing: replay and discard with
'idem dlq'. It has no authentication, so it listens on the loopback
interface by default; put it behind your own proxy to expose it.
Against DNS rebinding it answers only the names it is known by: localhost,
loopback addresses, the host of --addr and the names given with
--allow-host (and any IP address when --addr is every interface); other
Host headers get 421. The store is read at most once per --refresh, and
one read at a time, however many scrapes and page views arrive.
SIGINT or SIGTERM stops it gracefully (exit 0).

` + dsnHelp,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			sf := addStoreFlags(fs, "serve", false)
			addr := fs.String("addr", "127.0.0.1:9464", "`address` to listen on")
			var allow hostList
			fs.Var(&allow, "allow-host", "also answer requests for this host `name` (comma-separated or repeated), such as the name of a proxy in front")
			var refresh, readTimeout time.Duration
			durationVar(fs, &refresh, "refresh", 15*time.Second, "read the store for /metrics and the page at most once per `interval`; scrapes and views in between get the last reading")
			durationVar(fs, &readTimeout, "read-timeout", 10*time.Second, "bound on one read of the store for /metrics or the page (`duration`); counting takes about 0.2 s per million markers on Postgres")
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				if refresh < 0 {
					return usagef("--refresh %s is negative", refresh)
				}
				if readTimeout <= 0 {
					return usagef("--read-timeout %s must be positive", readTimeout)
				}
				s, err := sf.open(ctx, e)
				if err != nil {
					return err
				}
				defer s.Close()
				ln, err := net.Listen("tcp", *addr)
				if err != nil {
					return fmt.Errorf("listen: %w", err)
				}
				fmt.Fprintf(e.stdout, "idem serve: %s on http://%s (metrics at /metrics)\n", s, ln.Addr())
				h := guard(newHostPolicy(*addr, allow), newServeMux(ctx, s, refresh, readTimeout))
				return serve(ctx, ln, newHTTPServer(ctx, h, defaultServeTimeouts(readTimeout)))
			}
		},
	}
}

// serve runs srv on ln until ctx ends, then shuts down gracefully.
func serve(ctx context.Context, ln net.Listener, srv *http.Server) error {
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shut down: %w", err)
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}

// newServeMux routes serve's endpoints for s; /metrics reads the store at
// most once per refresh, and each read of the store is bounded by timeout
// and ends with ctx.
func newServeMux(ctx context.Context, s *store, refresh, timeout time.Duration) *http.ServeMux {
	return serveMuxFor(s, newReadingCache(ctx, s, refresh, timeout), timeout)
}

// serveMuxFor routes serve's endpoints for s, with the store's counts from
// cache.
func serveMuxFor(s *store, cache *readingCache, timeout time.Duration) *http.ServeMux {
	reg := prometheus.NewRegistry()
	reg.MustRegister(newStoreCollector(cache), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), serveHealthTimeout)
		defer cancel()
		n, _, err := s.schemaVersion(ctx)
		switch {
		case err != nil:
			http.Error(w, "store unavailable: "+err.Error(), http.StatusServiceUnavailable)
			return
		case n == 0:
			// It answers, but there is nothing to serve: what /metrics
			// reports as idem_store_up 0.
			http.Error(w, fmt.Sprintf("store unavailable: %s has no idem tables: run 'idem migrate' first", s), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) { servePage(w, r, s, cache, timeout) })
	return mux
}

// storeCollector reports the store's state to scrapes, from the reading
// cache it shares with the page.
type storeCollector struct {
	cache *readingCache

	up, markers, duplicates, stale, leases        *prometheus.Desc
	deadLetters, conflicts, oldestMarker          *prometheus.Desc
	outboxPending, outboxFailing, outboxPublished *prometheus.Desc
	outboxAge                                     *prometheus.Desc
}

// storeReading is one read of the store.
type storeReading struct {
	handlers []*handlerStats
	outbox   *outboxReport // nil for a schema from before the outbox
	err      error
	// downSince is when the reads began to fail, for an outage in
	// progress; zero when this one succeeded.
	downSince time.Time
}

// readStore reads the per-handler counts and the outbox.
func readStore(ctx context.Context, s *store) storeReading {
	var r storeReading
	var version int
	if r.handlers, version, r.err = collectStats(ctx, s); r.err == nil && s.hasOutbox(version) {
		r.outbox, r.err = readOutbox(ctx, s, time.Now())
	}
	return r
}

func newStoreCollector(cache *readingCache) *storeCollector {
	h := []string{"handler"}
	return &storeCollector{
		cache:           cache,
		up:              prometheus.NewDesc("idem_store_up", "1 if the last read of idem's tables succeeded, else 0.", nil, nil),
		markers:         prometheus.NewDesc("idem_store_markers", "Markers stored (messages applied, or done in lease mode) since the last cleanup.", h, nil),
		duplicates:      prometheus.NewDesc("idem_store_duplicates_total", "Redeliveries skipped, as flushed by StatsRecorder hooks.", h, nil),
		stale:           prometheus.NewDesc("idem_store_stale_total", "Deliveries the ordering guard skipped as stale, as flushed by StatsRecorder hooks.", h, nil),
		leases:          prometheus.NewDesc("idem_store_leases", "Lease-mode messages by status: in_flight (running now) or failed (waiting for a retry or failed for good).", []string{"handler", "status"}, nil),
		deadLetters:     prometheus.NewDesc("idem_store_dead_letters", "Dead letters kept, by state: parked (waiting for an operator) or all.", []string{"handler", "state"}, nil),
		conflicts:       prometheus.NewDesc("idem_store_conflicts", "Dead letters whose message ID arrived with a different payload.", h, nil),
		oldestMarker:    prometheus.NewDesc("idem_store_oldest_marker_timestamp_seconds", "When the oldest marker was written (about the retention when cleanup runs).", h, nil),
		outboxPending:   prometheus.NewDesc("idem_outbox_pending", "Outbox rows waiting for the relay.", nil, nil),
		outboxFailing:   prometheus.NewDesc("idem_outbox_failing", "Pending outbox rows with at least one failed publish.", nil, nil),
		outboxPublished: prometheus.NewDesc("idem_outbox_published", "Published outbox rows waiting for cleanup.", nil, nil),
		outboxAge:       prometheus.NewDesc("idem_outbox_oldest_pending_age_seconds", "Age of the oldest pending outbox row (0 when none): the relay's lag.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.markers, c.duplicates, c.stale, c.leases, c.deadLetters, c.conflicts, c.oldestMarker,
		c.outboxPending, c.outboxFailing, c.outboxPublished, c.outboxAge} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. A store that cannot be read
// yields idem_store_up 0, not a failed scrape, so the outage can alert.
func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	r, _ := c.cache.get(c.cache.base)
	if r.err != nil {
		ch <- constMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- constMetric(c.up, prometheus.GaugeValue, 1)
	labels := handlerLabels(r.handlers)
	for i, st := range r.handlers {
		h := labels[i]
		ch <- constMetric(c.markers, prometheus.GaugeValue, float64(st.Applied), h)
		ch <- constMetric(c.duplicates, prometheus.CounterValue, float64(st.Duplicates), h)
		ch <- constMetric(c.stale, prometheus.CounterValue, float64(st.Stale), h)
		ch <- constMetric(c.leases, prometheus.GaugeValue, float64(st.InFlight), h, "in_flight")
		ch <- constMetric(c.leases, prometheus.GaugeValue, float64(st.Failed), h, "failed")
		ch <- constMetric(c.deadLetters, prometheus.GaugeValue, float64(st.DeadParked), h, "parked")
		ch <- constMetric(c.deadLetters, prometheus.GaugeValue, float64(st.DeadTotal), h, "all")
		ch <- constMetric(c.conflicts, prometheus.GaugeValue, float64(st.Conflicts), h)
		if st.OldestMarker != nil {
			ch <- constMetric(c.oldestMarker, prometheus.GaugeValue, float64(st.OldestMarker.UnixMicro())/1e6, h)
		}
	}
	if ob := r.outbox; ob != nil {
		ch <- constMetric(c.outboxPending, prometheus.GaugeValue, float64(ob.Pending))
		ch <- constMetric(c.outboxFailing, prometheus.GaugeValue, float64(ob.Failing))
		ch <- constMetric(c.outboxPublished, prometheus.GaugeValue, float64(ob.Published))
		ch <- constMetric(c.outboxAge, prometheus.GaugeValue, float64(ob.AgeSeconds))
	}
}

// pageData is what the admin page shows.
type pageData struct {
	Store       string
	Now         time.Time
	Read        time.Time     // when the counts were read
	Refresh     time.Duration // how old they may be
	Estimate    *int64        // the planner's estimate of all markers, if known
	Err         string
	DownSince   time.Time     // when the store stopped answering, during an outage
	DownFor     time.Duration // how long it has not answered
	Handlers    []*handlerStats
	Outbox      *outboxReport
	DeadLetters []driver.DeadLetter
	Limit       int
}

// down records an outage that began at since.
func (d *pageData) down(since time.Time) {
	d.DownSince, d.DownFor = since.UTC().Truncate(time.Second), time.Since(since).Round(time.Second)
}

func servePage(w http.ResponseWriter, r *http.Request, s *store, cache *readingCache, timeout time.Duration) {
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	d := pageData{Store: s.String(), Now: time.Now().UTC().Truncate(time.Second), Limit: servePageDeadLetters, Refresh: cache.ttl}
	rd, read := cache.get(ctx)
	d.Read = read.UTC().Truncate(time.Second)
	if n, ok, err := s.markerEstimate(ctx); err == nil && ok {
		d.Estimate = &n // read on each view: a catalog lookup, not a count
	}
	d.Handlers, d.Outbox = rd.handlers, rd.outbox
	if !rd.downSince.IsZero() {
		d.down(rd.downSince)
	}
	err := rd.err
	if dl, ok := s.idemDriver().(driver.DeadLetterStore); ok && err == nil {
		d.DeadLetters, err = dl.DeadLetterList(ctx, &driver.DeadLetterFilter{State: driver.DeadLetterParked, Limit: servePageDeadLetters, Summary: true})
	}
	if err != nil {
		d.Err = err.Error()
		if rd.err == nil && ctx.Err() == nil {
			// The counts came from the cache; the store failed now.
			since := cache.failed()
			d.down(since)
		}
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if d.Err != "" {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	if err := pageTemplate.Execute(w, d); err != nil {
		// The header is out; all that is left is to stop writing.
		return
	}
}

var pageTemplate = template.Must(template.New("page").Funcs(template.FuncMap{
	"clip": clip,
	"term": termText,
	"when": func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
}).Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>idem · {{.Store}}</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border-bottom:1px solid #ddd;padding:.3em .8em;text-align:right}
th:first-child,td:first-child,td.text{text-align:left}
.err{color:#a00}.muted{color:#777}
</style></head><body>
<h1>idem</h1>
<p class="muted">{{.Store}} · {{when .Now}} · <a href="/metrics">metrics</a></p>
{{if .Err}}<p class="err">{{if not .DownSince.IsZero}}<strong>Outage in progress:</strong> the store has not answered since {{when .DownSince}} ({{.DownFor}}); consumers pause while it is down and resume by themselves. {{end}}The store could not be read: {{term .Err}}</p>{{end}}
<h2>Handlers</h2>
{{if not .Err}}<p class="muted">Counts as of {{when .Read}}: the store is read at most once every {{.Refresh}}, for this page and /metrics alike, so they may be that old.{{with .Estimate}} Markers now: about {{.}} in all (PostgreSQL's estimate, as of its last analysis of the table; not an exact count).{{end}}</p>{{end}}
{{if .Handlers}}<table>
<tr><th>handler</th><th>applied</th><th>duplicates</th><th>stale</th><th>in flight</th><th>failed</th><th>dead letters (parked / all)</th><th>conflicts</th><th>oldest marker</th></tr>
{{range .Handlers}}<tr><td>{{term .Handler}}</td><td>{{.Applied}}</td><td>{{.Duplicates}}</td><td>{{.Stale}}</td><td>{{.InFlight}}</td><td>{{.Failed}}</td><td>{{.DeadParked}} / {{.DeadTotal}}</td><td>{{.Conflicts}}</td><td>{{if .OldestMarker}}{{when .OldestMarker.UTC}}{{else}}-{{end}}</td></tr>
{{end}}</table>{{else if .Err}}<p class="muted">Unknown while the store does not answer.</p>{{else}}<p class="muted">No markers or dead letters stored yet.</p>{{end}}
{{with .Outbox}}<h2>Outbox</h2>
<table>
<tr><th>pending</th><th>oldest pending</th><th>failing</th><th>published, awaiting cleanup</th></tr>
<tr><td>{{.Pending}}</td><td>{{if .OldestPending}}{{when .OldestPending.UTC}} ({{.AgeSeconds}} s ago){{else}}-{{end}}</td><td>{{.Failing}}</td><td>{{.Published}}</td></tr>
</table>{{if .LastError}}<p class="err">last publish error: {{term .LastError}}</p>{{end}}{{end}}
<h2>Parked dead letters</h2>
{{if .DeadLetters}}<p class="muted">The oldest {{len .DeadLetters}} (at most {{.Limit}}). Replay or discard them with <code>idem dlq</code>.</p>
<table>
<tr><th>id</th><th>handler</th><th>message ID</th><th>class</th><th>attempts</th><th>last failed</th><th>error</th></tr>
{{range .DeadLetters}}<tr><td>{{.ID}}</td><td class="text">{{term .Handler}}</td><td class="text">{{if .MessageID}}{{term .MessageID}}{{else}}-{{end}}</td><td class="text">{{term .Class}}</td><td>{{.Attempts}}</td><td>{{when .LastFailed}}</td><td class="text">{{term (clip .Error 160)}}</td></tr>
{{end}}</table>{{else if $.Err}}<p class="muted">Unknown while the store does not answer.</p>{{else}}<p class="muted">None parked.</p>{{end}}
</body></html>
`))
