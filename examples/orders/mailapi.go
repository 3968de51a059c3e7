package main

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// email is what the e-mail API sends.
type email struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Text    string `json:"text"`
}

// mailAPI stands in for an e-mail provider: POST /send sends an e-mail
// once per Idempotency-Key, as such APIs do, however often it is called.
// GET /sent reports what it sent and how often each key was asked.
type mailAPI struct {
	failEvery int           // fail the first request of about one key in failEvery with 503; 0: never
	delay     time.Duration // the time a send takes
	log       io.Writer

	mu       sync.Mutex
	sent     map[string]email // by idempotency key
	requests map[string]int
	inFlight map[string]bool
	overlaps int // requests for a key while another for it was under way
}

func newMailAPI(failEvery int, log io.Writer) *mailAPI {
	return &mailAPI{failEvery: failEvery, log: log,
		sent: map[string]email{}, requests: map[string]int{}, inFlight: map[string]bool{}}
}

// mailReport is the body of GET /sent.
type mailReport struct {
	Sent     map[string]email `json:"sent"`
	Requests map[string]int   `json:"requests"`
	Overlaps int              `json:"overlaps"`
}

func (a *mailAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet && r.URL.Path == "/sent" {
		a.mu.Lock()
		defer a.mu.Unlock()
		_ = json.NewEncoder(w).Encode(mailReport{Sent: a.sent, Requests: a.requests, Overlaps: a.overlaps})
		return
	}
	if r.Method != http.MethodPost || r.URL.Path != "/send" {
		http.NotFound(w, r)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	var e email
	if err := json.NewDecoder(r.Body).Decode(&e); err != nil || key == "" || e.To == "" {
		http.Error(w, "want an Idempotency-Key and a JSON e-mail", http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	a.requests[key]++
	n := a.requests[key]
	if a.inFlight[key] {
		a.overlaps++
	}
	a.inFlight[key] = true
	a.mu.Unlock()
	time.Sleep(a.delay)
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.inFlight, key)
	if h := fnv.New32a(); a.failEvery > 0 && n == 1 {
		h.Write([]byte(key))
		if h.Sum32()%uint32(a.failEvery) == 0 {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
	}
	if _, dup := a.sent[key]; !dup {
		a.sent[key] = e
		if a.log != nil {
			fmt.Fprintf(a.log, "e-mail API: sent %q to %s\n", e.Subject, e.To)
		}
	}
	w.WriteHeader(http.StatusOK)
}

// listen serves the API on a local port.
func (a *mailAPI) listen() (*http.Server, string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	srv := &http.Server{Handler: a, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return srv, "http://" + ln.Addr().String(), nil
}
