package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem"
)

// demoMailFailEvery makes the demo's mail service refuse every so many
// calls, as a real one does under load.
const demoMailFailEvery = 25

// demoMailer is the demo's mail service: it counts the emails it accepted
// per signup and refuses every demoMailFailEvery-th call with a transient
// error.
type demoMailer struct {
	mu      sync.Mutex
	calls   int
	refused int
	sent    map[string]int // signup ID → emails accepted
}

var errMailBusy = errors.New("mail service: 421 try again later")

func (m *demoMailer) send(id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls++
	if m.calls%demoMailFailEvery == 0 {
		m.refused++
		return errMailBusy
	}
	m.sent[id]++
	return nil
}

// runLeaseDemo is the broker demo in lease mode: a welcome email per
// signup, sent through idem.LeaseConsumer to a mail service that refuses
// some calls, with signups published twice and consumers killed
// mid-stream. It verifies that every signup got exactly one email.
func runLeaseDemo(ctx context.Context, e *env, cfg *demoConfig) error {
	s, err := setUpBrokerDemo(ctx, cfg, "SELECT 1")
	if err != nil {
		return err
	}
	defer s.close()
	b, drv, path := s.b, s.drv, s.path
	quiet := slog.New(slog.DiscardHandler)
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "demo", TTL: time.Minute,
		BackoffBase: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond, Logger: quiet})
	if err != nil {
		return err
	}
	mail := &demoMailer{sent: map[string]int{}}
	welcome := &idem.LeaseHandler{Name: "emails.welcome", Call: func(ctx context.Context, l *idem.Lease, m *idem.Message) error {
		return mail.send(m.ID) // a real call would pass l.IdempotencyKey along
	}}
	consumer, err := idem.NewLeaseConsumer(lp, welcome, drv, &idem.ConsumerConfig{Logger: quiet,
		Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		return err
	}

	// Signups, a share of them published twice (a producer's retry).
	rng := rand.New(rand.NewPCG(cfg.seed, 0x1ea5e))
	var msgs []*idem.Message
	republished := 0
	for i := range cfg.events {
		m := &idem.Message{ID: demoSignupID(i), Type: "UserSignedUp", AggregateID: fmt.Sprintf("user-%06d", i),
			Payload: fmt.Appendf(nil, `{"user":"user-%06d"}`, i)}
		msgs = append(msgs, m)
		if rng.Float64() < cfg.dupRate {
			msgs = append(msgs, m)
			republished++
		}
	}
	fmt.Fprintf(e.stdout, "idem demo --lease: welcome emails in lease mode, leases on SQLite at %s,\n", path)
	fmt.Fprintf(e.stdout, "  fed by %s\n", b.describe())
	fmt.Fprintf(e.stdout, "  %d signups, %d published twice; the mail service refuses every %dth call\n", cfg.events, republished, demoMailFailEvery)
	fmt.Fprintf(e.stdout, "  %d consumers sharing the stream; two are killed mid-stream and replaced\n", natsDemoConsumers)

	counts := &demoCounts{conflictIDs: map[string]int{}}
	b.setHandler(&countingHandler{next: consumer, counts: counts})
	start := time.Now()
	if err := b.publish(ctx, msgs); err != nil {
		return err
	}
	defer b.stopAll()
	prog := newProgress(e.stdout, int64(cfg.events), "emails sent")
	killed, err := superviseDemo(ctx, b, prog, int64(cfg.events), counts.applied.Load, func(n int64) (bool, error) {
		return n >= int64(cfg.events), nil
	})
	if err != nil {
		return err
	}
	prog.Finish()
	// Let the killed consumers' leftovers and the second copies come
	// back: they are duplicates.
	time.Sleep(natsDemoAckWait + 200*time.Millisecond)
	b.stopAll()
	elapsed := time.Since(start)

	mail.mu.Lock()
	defer mail.mu.Unlock()
	wrong := checkEmails(mail.sent, cfg.events)
	row := func(label string, value any) { fmt.Fprintf(e.stdout, "  %-20s %12v\n", label, value) }
	fmt.Fprintf(e.stdout, "\n  consumers killed %16d  (%s)\n\n", killed, b.killNote())
	row("signups", cfg.events)
	row("deliveries", counts.applied.Load()+counts.duplicates.Load()+counts.retries.Load())
	row("emails sent", len(mail.sent))
	row("duplicates skipped", counts.duplicates.Load())
	row("calls refused", mail.refused)
	row("retries asked", counts.retries.Load())
	row("wrong email counts", len(wrong))
	row("elapsed", elapsed.Round(time.Millisecond))
	fmt.Fprintln(e.stdout)
	if len(wrong) > 0 {
		fmt.Fprintf(e.stdout, "verification: FAILED — %d emails for %d signups; %s\n", len(mail.sent), cfg.events,
			strings.Join(wrong[:min(len(wrong), demoShowMismatches)], "; "))
		return errors.New("verification failed: see the report above")
	}
	fmt.Fprintln(e.stdout, "verification: OK — every signup got exactly one welcome email")
	return nil
}

// checkEmails compares the emails sent per signup with the intended ones,
// one for each of the signups signup-000000 … (computed from the count,
// not from the published stream), and describes every difference.
func checkEmails(sent map[string]int, signups int) []string {
	var wrong []string
	want := map[string]bool{}
	for i := range signups {
		id := demoSignupID(i)
		want[id] = true
		if n := sent[id]; n != 1 {
			wrong = append(wrong, fmt.Sprintf("%s: %d emails", id, n))
		}
	}
	for id, n := range sent {
		if !want[id] {
			wrong = append(wrong, fmt.Sprintf("%s: %d emails, for no signup", id, n))
		}
	}
	return wrong
}

// demoSignupID is the message ID of the i-th signup.
func demoSignupID(i int) string { return fmt.Sprintf("signup-%06d", i) }
