package main

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// chaosSink is the run's HTTP server. At /effect it is the lease handler's
// downstream, a payment API in miniature: it applies the effect of an
// Idempotency-Key once, answers a repeated call as a success without
// applying it again, and refuses a call whose Fencing-Token is below the
// highest it has seen for the key (a worker that lost its lease). At
// /report it takes the consumers' counts.
type chaosSink struct {
	srv *http.Server
	url string

	mu       sync.Mutex
	keys     map[string]*chaosKey
	applied  int64 // keys applied: the effects
	calls    int64
	fenced   int64 // calls refused for a stale token
	overlaps int64 // calls for a key while another for it was running
	reports  map[string]chaosReport
}

// chaosSinkWork is how long the sink takes over an effect.
const chaosSinkWork = time.Millisecond

// chaosKey is what the sink knows about one idempotency key.
type chaosKey struct {
	calls    int
	effects  int
	token    int64
	inflight int
}

// newChaosSink starts the sink on a loopback port.
func newChaosSink() (*chaosSink, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &chaosSink{url: "http://" + l.Addr().String(), keys: map[string]*chaosKey{}, reports: map[string]chaosReport{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /effect", s.effect)
	mux.HandleFunc("POST /report", s.report)
	s.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = s.srv.Serve(l) }()
	return s, nil
}

func (s *chaosSink) effect(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	token, err := strconv.ParseInt(r.Header.Get("Fencing-Token"), 10, 64)
	if key == "" || err != nil {
		http.Error(w, "Idempotency-Key and Fencing-Token required", http.StatusBadRequest)
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
	s.mu.Lock()
	k := s.keys[key]
	if k == nil {
		k = &chaosKey{}
		s.keys[key] = k
	}
	s.calls++
	k.calls++
	if k.inflight > 0 {
		s.overlaps++
	}
	if token < k.token {
		s.fenced++
		s.mu.Unlock()
		http.Error(w, "stale fencing token", http.StatusConflict)
		return
	}
	k.token = token
	k.inflight++
	s.mu.Unlock()
	// The API's own work, during which a second call for the key, one
	// that two lease holders made at once, would overlap this one.
	time.Sleep(chaosSinkWork)
	s.mu.Lock()
	if k.effects == 0 {
		k.effects = 1
		s.applied++
	}
	k.inflight--
	s.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func (s *chaosSink) report(w http.ResponseWriter, r *http.Request) {
	var rep chaosReport
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&rep); err != nil || rep.Incarnation == "" {
		http.Error(w, "bad report", http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	s.reports[rep.Incarnation] = rep
	s.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

// effects returns how many keys the sink applied.
func (s *chaosSink) effects() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.applied
}

// totals sums the consumers' last reports per handler.
func (s *chaosSink) totals() map[string]chaosCountsJSON {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := map[string]chaosCountsJSON{}
	for _, r := range s.reports {
		for h, c := range r.Counts {
			sum := t[h]
			sum.add(c)
			t[h] = sum
		}
	}
	return t
}

func (s *chaosSink) close() { _ = s.srv.Close() }
