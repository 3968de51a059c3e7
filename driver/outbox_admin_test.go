package driver

import (
	"testing"
	"time"
)

func TestOutboxEntrySetListed(t *testing.T) {
	at, end := time.UnixMicro(1_700_000_000_000_000), time.UnixMicro(1_700_000_060_000_000)
	for _, c := range []struct {
		name     string
		attempts int
		parkedAt time.Time
		claimed  bool
		owner    string
		want     OutboxEntry
	}{
		{name: "pending", want: OutboxEntry{State: OutboxPending}},
		{name: "failing, held", attempts: 2, claimed: true, want: OutboxEntry{State: OutboxFailing, HeldUntil: end}},
		{name: "parked, claimed", attempts: 1, parkedAt: at, claimed: true, owner: "relay-1",
			want: OutboxEntry{State: OutboxParked, ParkedAt: at, ClaimedBy: "relay-1", ClaimedUntil: end}},
	} {
		e := OutboxEntry{}
		e.Attempts = c.attempts
		e.SetListed(c.parkedAt, c.claimed, c.owner, end)
		c.want.Attempts = c.attempts
		if e.State != c.want.State || !e.ParkedAt.Equal(c.want.ParkedAt) || !e.HeldUntil.Equal(c.want.HeldUntil) ||
			e.ClaimedBy != c.want.ClaimedBy || !e.ClaimedUntil.Equal(c.want.ClaimedUntil) {
			t.Errorf("%s: got state %s parked %v held %v claim %q %v", c.name, e.State, e.ParkedAt, e.HeldUntil, e.ClaimedBy, e.ClaimedUntil)
		}
	}
}

func TestOutboxPageTrim(t *testing.T) {
	p := OutboxPage{Rows: []OutboxEntry{{}, {}, {}}}
	p.Rows[0].ID, p.Rows[1].ID, p.Rows[2].ID = 4, 7, 9
	p.Trim(2)
	if len(p.Rows) != 2 || p.Next != 7 {
		t.Fatalf("trimmed to %d rows, next %d; want 2 and 7", len(p.Rows), p.Next)
	}
	p.Trim(2)
	if len(p.Rows) != 2 || p.Next != 7 {
		t.Fatalf("a second trim changed the page: %d rows, next %d", len(p.Rows), p.Next)
	}
}
