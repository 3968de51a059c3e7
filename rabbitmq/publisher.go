package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem"
)

// confirmChunk bounds how many messages a Publish sends before it waits
// for their confirms: the returns they may cause must fit the channel's
// buffer (see pubChannel).
const confirmChunk = 256

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// URL is the broker's AMQP URI. Required.
	URL string
	// AMQP configures the connection; its Properties["connection_name"]
	// defaults to "idem publisher". Its Recovery must be nil: the
	// publisher connects again itself, at the next Publish after a
	// failure.
	AMQP amqp.Config
	// Exchange is the exchange messages are published to, with the
	// message's Stream as the routing key. Default "", the default
	// exchange, which routes to the queue named by the routing key.
	Exchange string
}

// Publisher publishes messages to RabbitMQ and returns only once the
// broker has confirmed every one of them: the outbox relay's Publisher
// (see idem's outbox package). Messages go to PublisherConfig.Exchange
// with their Stream as the routing key, persistent, with the mandatory
// flag: a message no queue takes is returned by the broker, and Publish
// fails with ErrUnroutable rather than report a success for a message
// that went nowhere. The ID travels in the message-id property, the type
// in the type property; the aggregate, sequence and time in the headers
// DefaultMap reads, with the message's own Headers.
//
// A Publish sends its messages in order on one channel and waits for
// their confirms together (up to 256 at a time), so one aggregate's
// messages keep their order. Publish may be called concurrently: each
// call takes a channel of its own.
type Publisher struct {
	cfg   PublisherConfig
	mu    sync.Mutex
	conn  *amqp.Connection
	idle  []*pubChannel
	close bool
	// sock is conn's network connection, read without mu: a call stuck
	// on a broker that stopped reading may hold mu (see cutWhenStuck).
	sock atomic.Pointer[socket]
	// blk is conn's connection.blocked state, read without mu.
	blk atomic.Pointer[blocking]
	// alarm is set while the broker is believed to block publishing: from
	// a connection.blocked until a connection.unblocked, or a probe on a
	// later connection (after a cut) that the broker answers (Probe).
	alarm atomic.Bool
	// opening counts the channel opens under way (under mu): a
	// connection blocked meanwhile is cut, since they would wait for the
	// alarm to clear.
	opening atomic.Int32
}

// stuckGrace is how long a Publish may go on after its context ended
// before the publisher takes the broker for one that stopped reading and
// closes the connection's socket (see cutWhenStuck). A broker that reads
// answers a cancelled call's channel close in milliseconds.
const stuckGrace = time.Second

// closeTimeout bounds Close's wait for the broker's answer: a broker that
// stopped reading (a memory or disk alarm) never gives it.
const closeTimeout = 2 * time.Second

// pubChannel is a channel in confirm mode with its returns, and the
// broker's reason when it closes the channel.
type pubChannel struct {
	ch      *amqp.Channel
	returns chan amqp.Return
	closed  chan *amqp.Error
	blk     *blocking // its connection's connection.blocked state
}

// closeReasonWait bounds closeReason's wait for the reason of a close
// under way.
const closeReasonWait = time.Second

// closeReason returns why the broker closed pc (a message over its
// max_message_size, an exchange that does not exist: a refusal that a
// row's last error must name), or amqp.ErrClosed when it gave none.
// Called once pc is closed. amqp091 marks a channel closed as soon as it
// reads the broker's channel.close, before it hands the reason to
// NotifyClose: a publish racing the close fails with amqp.ErrClosed
// first, so the reason is waited for, no longer than ctx. It comes at
// once, or the notify channel is closed (a close of our own).
func (pc *pubChannel) closeReason(ctx context.Context) error {
	t := time.NewTimer(closeReasonWait)
	defer t.Stop()
	select {
	case e, ok := <-pc.closed:
		if ok && e != nil {
			return e
		}
	case <-t.C:
	case <-ctx.Done():
	}
	return amqp.ErrClosed
}

// NewPublisher returns a Publisher. It connects at the first Publish.
func NewPublisher(cfg *PublisherConfig) (*Publisher, error) {
	switch {
	case cfg == nil || cfg.URL == "":
		return nil, fmt.Errorf("%w: rabbitmq: PublisherConfig.URL is required", idem.ErrInvalidConfig)
	case cfg.AMQP.Recovery != nil:
		return nil, fmt.Errorf("%w: rabbitmq: PublisherConfig.AMQP.Recovery must be nil", idem.ErrInvalidConfig)
	}
	if _, err := amqp.ParseURI(cfg.URL); err != nil {
		return nil, fmt.Errorf("%w: rabbitmq: PublisherConfig.URL: %w", idem.ErrInvalidConfig, err)
	}
	p := &Publisher{cfg: *cfg}
	props := amqp.Table{}
	for k, v := range cfg.AMQP.Properties {
		props[k] = v
	}
	if _, ok := props["connection_name"]; !ok {
		props["connection_name"] = "idem publisher"
	}
	p.cfg.AMQP.Properties = props
	return p, nil
}

// Close closes the publisher's connection. It waits for the broker at
// most closeTimeout, then closes the socket, also when a Publish is stuck
// on a broker that stopped reading.
func (p *Publisher) Close() error {
	if s := p.sock.Load(); s != nil {
		t := time.AfterFunc(closeTimeout, s.close)
		defer t.Stop()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.close = true
	p.idle = nil
	if p.conn == nil {
		return nil
	}
	err := p.conn.Close()
	p.conn = nil
	if errors.Is(err, amqp.ErrClosed) {
		return nil
	}
	return err
}

// channel takes an idle channel, or opens one (connecting first if need
// be). ctx's end cuts a connect short, even on a broker that does not
// answer (see dialContext), as the consumer's.
func (p *Publisher) channel(ctx context.Context) (*pubChannel, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.close {
		return nil, fmt.Errorf("rabbitmq: publisher: %w", amqp.ErrClosed)
	}
	// Counted before the blocked check: a connection.blocked arriving
	// after it sees the open under way and cuts the connection, since
	// the open would wait for the alarm to clear, under mu.
	p.opening.Add(1)
	defer p.opening.Add(-1)
	if p.sock.Load().isClosed() {
		p.idle = nil // on the connection cutWhenStuck cut
	} else if p.conn != nil && !p.conn.IsClosed() {
		if berr, _ := p.blk.Load().err(); berr != nil {
			return nil, fmt.Errorf("rabbitmq: publisher: %w", berr)
		}
	}
	for len(p.idle) > 0 {
		pc := p.idle[len(p.idle)-1]
		p.idle = p.idle[:len(p.idle)-1]
		if !pc.ch.IsClosed() {
			return pc, nil
		}
	}
	// A socket cut under a stuck call (cutWhenStuck) closes the
	// connection once amqp091's reader notices: do not wait for that.
	if p.conn == nil || p.conn.IsClosed() || p.sock.Load().isClosed() {
		if p.conn != nil {
			_ = p.conn.Close()
		}
		sock := &socket{}
		unwatch := context.AfterFunc(ctx, sock.close)
		conn, err := dialContext(ctx, p.cfg.URL, p.cfg.AMQP, sock)
		unwatch()
		if err != nil {
			return nil, fmt.Errorf("rabbitmq: publisher: connect: %w", err)
		}
		p.conn, p.idle = conn, nil
		p.sock.Store(sock)
		b := newBlocking()
		p.blk.Store(b)
		go b.watch(conn.NotifyBlocked(make(chan amqp.Blocking, 1)), func(active bool, _ string) {
			if p.blk.Load() != b {
				return // a connection since replaced: its news is stale
			}
			p.alarm.Store(active)
			if active && p.opening.Load() > 0 {
				sock.close()
			}
		})
	}
	ch, err := p.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: publisher: open channel: %w", p.blk.Load().explain(err))
	}
	if err := ch.Confirm(false); err != nil {
		err = p.blk.Load().explain(err)
		ch.Close()
		return nil, fmt.Errorf("rabbitmq: publisher: confirm mode: %w", err)
	}
	// Returns come before their publish's confirm; waiting for the
	// confirms of at most confirmChunk messages, the buffer holds all
	// the returns they can cause.
	// amqp091 sends the close reason to closed before it fails the
	// confirms still awaited.
	return &pubChannel{ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, confirmChunk)), closed: ch.NotifyClose(make(chan *amqp.Error, 1)), blk: p.blk.Load()}, nil
}

// release gives pc back, or closes it after a failure.
func (p *Publisher) release(pc *pubChannel, failed bool) {
	if failed {
		pc.ch.Close()
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.close {
		return
	}
	p.idle = append(p.idle, pc)
}

// Unavailable reports whether err, returned by Publish, may come from the
// broker being out of reach rather than from a message (an invalid one)
// or the broker's answer about it (ErrUnroutable, ErrNacked, access
// refused, a missing exchange, a failed precondition): the outbox relay
// then probes the broker (Probe) and, if the probe fails too, pauses its
// publishes without counting an attempt on the rows
// (outbox.BrokerProber).
func (p *Publisher) Unavailable(err error) bool {
	var ae *amqp.Error
	if errors.As(err, &ae) && (ae.Code == amqp.AccessRefused || ae.Code == amqp.NotFound || ae.Code == amqp.PreconditionFailed) {
		return false // the broker answered, with a refusal
	}
	return err != nil && !errors.Is(err, idem.ErrInvalidMessage) && !errors.Is(err, ErrUnroutable) && !errors.Is(err, ErrNacked)
}

// Probe returns nil when the broker answers: it takes a channel as
// Publish does (connecting first if need be, then opening one in confirm
// mode) and keeps it for the next Publish; see Unavailable. ctx bounds a
// connect.
//
// A connection the broker blocked (a memory or disk alarm) fails the
// probe with ErrBlocked until the broker unblocks it. After an alarm
// seen on a connection since closed, the probe also publishes empty
// messages that no queue takes (see probePublish): a new connection is
// blocked only once it publishes. Any answer to them passes (a confirm, a
// nack, a refusal such as a user who may not write to the default
// exchange): the broker reads the connection again.
func (p *Publisher) Probe(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	defer p.cutWhenStuck(ctx)()
	pc, err := p.channel(ctx)
	if err != nil {
		return fmt.Errorf("rabbitmq: probe: %w", err)
	}
	berr, on := pc.blk.err()
	if berr != nil {
		p.release(pc, false)
		return fmt.Errorf("rabbitmq: probe: %w", berr)
	}
	if !p.alarm.Load() {
		p.release(pc, false)
		return nil
	}
	err = p.probePublish(ctx, pc, on)
	if errors.Is(err, ErrBlocked) || (err != nil && !answered(err)) {
		return fmt.Errorf("rabbitmq: probe: publish: %w", err)
	}
	if err != nil {
		// Nacked or refused: the broker read the first publish, after
		// which, under an alarm, it blocks the connection. It must read
		// a channel's open and close too.
		if err := p.roundTrip(); err != nil {
			return fmt.Errorf("rabbitmq: probe: %w", err)
		}
	}
	if berr, _ := pc.blk.err(); berr != nil {
		return fmt.Errorf("rabbitmq: probe: %w", berr)
	}
	p.alarm.Store(false) // the broker reads this connection
	return nil
}

// roundTrip opens and closes a channel on the current connection: two
// calls the broker must read. A connection.blocked meanwhile cuts the
// connection (see channel) and fails it with ErrBlocked.
func (p *Publisher) roundTrip() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn == nil || p.conn.IsClosed() {
		return fmt.Errorf("rabbitmq: publisher: %w", amqp.ErrClosed)
	}
	p.opening.Add(1)
	defer p.opening.Add(-1)
	b := p.blk.Load()
	if berr, _ := b.err(); berr != nil {
		return berr
	}
	ch, err := p.conn.Channel()
	if err == nil {
		err = ch.Close()
	}
	if err != nil {
		return b.explain(err)
	}
	if berr, _ := b.err(); berr != nil {
		return berr
	}
	return nil
}

// probePublish publishes on pc, twice, an empty message that no queue
// takes (the default exchange, an empty routing key, not mandatory), and
// waits for their confirms: a broker under an alarm reads the first
// publish of a connection, and may confirm it, before it blocks the
// connection; the second it does not read. It gives pc back, or leaves it
// to close once the broker reads again.
func (p *Publisher) probePublish(ctx context.Context, pc *pubChannel, on <-chan struct{}) error {
	bctx, done := cancelWhenBlocked(ctx, pc.blk, on)
	defer done()
	var err error
	for range 2 {
		var dc *amqp.DeferredConfirmation
		dc, err = pc.ch.PublishWithDeferredConfirmWithContext(bctx, "", "", false, false, amqp.Publishing{})
		if err == nil {
			var ok bool
			if ok, err = dc.WaitContext(bctx); err == nil && !ok {
				err = ErrNacked
				if pc.ch.IsClosed() {
					err = pc.closeReason(bctx) // refused: the channel closed
				}
			}
		}
		if err != nil {
			break
		}
	}
	switch cause := context.Cause(bctx); {
	case err == nil:
		p.release(pc, false)
	case errors.Is(cause, ErrBlocked):
		go pc.ch.Close() // waits for the broker to read again
		return cause
	default:
		p.release(pc, true)
	}
	return err
}

// answered reports whether err, of a probe's publish, is the broker's
// answer (a nack, or a channel closed with a reply code: a vhost whose
// user may not write to the default exchange, say): it reads the
// connection, which is all a probe asks.
func answered(err error) bool {
	var ae *amqp.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case amqp.AccessRefused, amqp.NotFound, amqp.ResourceLocked, amqp.PreconditionFailed, amqp.NotAllowed:
			return true
		}
	}
	return errors.Is(err, ErrNacked)
}

// Publish sends msgs in order and returns nil once the broker confirmed
// them all. It refuses the call, sending nothing, if any message is
// invalid (Message.ValidatePublish; Stream is the routing key). A message
// returned unroutable fails the call with ErrUnroutable, one the broker
// refused with ErrNacked; the messages before it may have been stored
// (the relay sends them again, and the consumers take them as
// duplicates).
func (p *Publisher) Publish(ctx context.Context, msgs []*idem.Message) error {
	for _, m := range msgs {
		if err := m.ValidatePublish(); err != nil {
			return fmt.Errorf("rabbitmq: publish: %w", err)
		}
	}
	if len(msgs) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("rabbitmq: publish: %w", err)
	}
	defer p.cutWhenStuck(ctx)()
	pc, err := p.channel(ctx)
	if err == nil {
		err = p.publishUnblocked(ctx, pc, msgs)
	}
	if err != nil && ctx.Err() != nil && !errors.Is(err, ctx.Err()) {
		// Cut short: the call's own error says how.
		err = fmt.Errorf("rabbitmq: publish: %w: %w", ctx.Err(), err)
	}
	return err
}

// publishUnblocked publishes msgs on pc unless its connection is blocked,
// and gives up with an error matching ErrBlocked as soon as the broker
// blocks it: the broker reads nothing more from it, so no confirm would
// come before the alarm clears.
func (p *Publisher) publishUnblocked(ctx context.Context, pc *pubChannel, msgs []*idem.Message) error {
	berr, on := pc.blk.err()
	if berr != nil {
		p.release(pc, false)
		return fmt.Errorf("rabbitmq: publish: %w", berr)
	}
	bctx, done := cancelWhenBlocked(ctx, pc.blk, on)
	defer done()
	err := p.publish(bctx, pc, msgs)
	if cause := context.Cause(bctx); err != nil && errors.Is(cause, ErrBlocked) && p.Unavailable(err) {
		// A refusal read before the block stays a refusal. Otherwise
		// its close would wait for the broker to read again.
		go pc.ch.Close()
		return fmt.Errorf("rabbitmq: publish: %w", cause)
	}
	p.release(pc, err != nil)
	return err
}

// cutWhenStuck watches a Publish: if it is still running stuckGrace after
// ctx ended, the broker is taken for one that stopped reading, and the
// connection's socket is closed. A broker under a memory or disk alarm
// stops reading from publishing connections and amqp091 has no deadline
// for its writes and calls: a publish whose write filled the socket
// buffers, the close of a channel whose confirms never came, the opening
// of one would each wait until the alarm clears, past the caller's stop,
// and the publisher's mutex with them. The connection is wedged for every
// channel on it by then; the next Publish connects again. It returns the
// function that ends the watch.
func (p *Publisher) cutWhenStuck(ctx context.Context) func() {
	done := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		t := time.NewTimer(stuckGrace)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
			if s := p.sock.Load(); s != nil {
				s.close()
			}
		}
	})
	return func() {
		close(done)
		stop()
	}
}

// publish sends msgs on pc, waiting for the confirms of each chunk.
func (p *Publisher) publish(ctx context.Context, pc *pubChannel, msgs []*idem.Message) error {
	for lo := 0; lo < len(msgs); lo += confirmChunk {
		chunk := msgs[lo:min(lo+confirmChunk, len(msgs))]
		dcs := make([]*amqp.DeferredConfirmation, len(chunk))
		for i, m := range chunk {
			dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, p.cfg.Exchange, m.Stream, true, false, publishing(m))
			if err != nil {
				if errors.Is(err, amqp.ErrClosed) {
					err = pc.closeReason(ctx) // closed by the broker after an earlier message
				}
				return fmt.Errorf("rabbitmq: publish %q to %q: %w", m.ID, m.Stream, err)
			}
			dcs[i] = dc
		}
		for i, dc := range dcs {
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return fmt.Errorf("rabbitmq: confirm of %q: %w", chunk[i].ID, err)
			}
			if !ok {
				if pc.ch.IsClosed() {
					return fmt.Errorf("rabbitmq: confirm of %q: %w", chunk[i].ID, pc.closeReason(ctx))
				}
				return fmt.Errorf("%w: %q to %q", ErrNacked, chunk[i].ID, chunk[i].Stream)
			}
		}
		select {
		case r, open := <-pc.returns:
			if !open {
				return fmt.Errorf("rabbitmq: publish: %w", amqp.ErrClosed)
			}
			return fmt.Errorf("%w: %q to exchange %q with routing key %q: %d %s", ErrUnroutable, r.MessageId, r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText)
		default:
		}
	}
	return nil
}

// publishing is m as DefaultMap reads it back.
func publishing(m *idem.Message) amqp.Publishing {
	h := amqp.Table{}
	for k, v := range m.Headers {
		h[k] = v
	}
	if m.AggregateID != "" {
		h[HeaderAggregate] = m.AggregateID
	}
	if m.Seq > 0 {
		h[HeaderSeq] = m.Seq
	}
	if !m.Time.IsZero() {
		h[HeaderTime] = m.Time.Format(time.RFC3339Nano)
	}
	pub := amqp.Publishing{Headers: h, MessageId: m.ID, Type: m.Type, DeliveryMode: amqp.Persistent, Body: m.Payload}
	if !m.Time.IsZero() {
		pub.Timestamp = m.Time
	}
	return pub
}
