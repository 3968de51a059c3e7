package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrBlocked matches the error of a Publish or Probe on a connection the
// broker blocked (connection.blocked): a memory or disk alarm, during
// which the broker reads nothing more from connections that publish. It
// is the broker out of reach, not the messages' failure (Unavailable is
// true): the outbox relay pauses without counting attempts, until the
// broker unblocks the connection.
var ErrBlocked = errors.New("rabbitmq: the broker blocks publishing (a resource alarm)")

// blocking is a connection's connection.blocked state, from amqp091's
// NotifyBlocked.
type blocking struct {
	mu     sync.Mutex
	active bool
	reason string
	on     chan struct{} // closed when the connection gets blocked; a new one once unblocked
}

func newBlocking() *blocking { return &blocking{on: make(chan struct{})} }

// watch records the notifications of c until it closes (the connection
// shut down), telling alarm each change.
func (b *blocking) watch(c <-chan amqp.Blocking, alarm func(active bool, reason string)) {
	for n := range c {
		b.mu.Lock()
		switch {
		case n.Active && !b.active:
			b.active, b.reason = true, n.Reason
			close(b.on)
		case !n.Active && b.active:
			b.active, b.reason = false, ""
			b.on = make(chan struct{})
		}
		b.mu.Unlock()
		alarm(n.Active, n.Reason)
	}
}

// err returns an error matching ErrBlocked while the connection is
// blocked, else nil and the channel closed when it gets blocked.
func (b *blocking) err() (error, <-chan struct{}) {
	if b == nil {
		return nil, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.active {
		return fmt.Errorf("%w: %s", ErrBlocked, b.reason), nil
	}
	return nil, b.on
}

// explain returns err, a call's failure on b's connection, wrapped in
// ErrBlocked's error when the connection is blocked (the alarm cut it).
func (b *blocking) explain(err error) error {
	if berr, _ := b.err(); berr != nil {
		return fmt.Errorf("%w (%w)", berr, err)
	}
	return err
}

// cancelWhenBlocked returns ctx, cancelled with an error matching
// ErrBlocked once the connection of b gets blocked, and its release.
func cancelWhenBlocked(ctx context.Context, b *blocking, on <-chan struct{}) (context.Context, func()) {
	if on == nil {
		return ctx, func() {}
	}
	bctx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	go func() {
		select {
		case <-on:
			err, _ := b.err()
			if err == nil {
				err = ErrBlocked // unblocked again already
			}
			cancel(err)
		case <-done:
		}
	}()
	return bctx, func() { close(done); cancel(nil) }
}
