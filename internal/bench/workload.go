package bench

import (
	"fmt"
	"slices"
	"strconv"

	"github.com/idemhq/idem"
)

// maxAmount bounds the amount of one event (amounts are 1…maxAmount).
const maxAmount = 100

// generator builds one worker's messages. Its buffers are reused from one
// transaction to the next: no target retains a message after returning.
type generator struct {
	prefix   string
	seqBase  int64    // added to a message's number to form its Seq
	accounts []string // the accounts this worker owns
	amounts  [][]byte // decimal payloads "1"…"100"
	msgs     []idem.Message
	ptrs     []*idem.Message
	id       []byte
}

// newGenerator returns the generator of worker w out of workers, which owns
// every account whose index is w modulo workers.
func newGenerator(prefix string, seqBase int64, w, workers, accounts, unit int) *generator {
	g := &generator{
		prefix:  prefix,
		seqBase: seqBase,
		amounts: make([][]byte, maxAmount),
		msgs:    make([]idem.Message, unit),
		ptrs:    make([]*idem.Message, unit),
		id:      make([]byte, 0, len(prefix)+1+20),
	}
	for a := w; a < accounts; a += workers {
		g.accounts = append(g.accounts, fmt.Sprintf("acct-%06d", a))
	}
	for i := range g.amounts {
		g.amounts[i] = strconv.AppendInt(nil, int64(i+1), 10)
	}
	return g
}

// messages returns the messages with sequence numbers lo…hi-1. The slice
// and the messages are valid until the next call.
func (g *generator) messages(lo, hi int64) []*idem.Message {
	n := int(hi - lo)
	for k := range n {
		seq := lo + int64(k)
		r := mix(uint64(seq))
		g.id = append(g.id[:0], g.prefix...)
		g.id = append(g.id, '-')
		g.id = appendPadded(g.id, seq, 12)
		g.msgs[k] = idem.Message{
			ID:          string(g.id),
			AggregateID: g.accounts[r%uint64(len(g.accounts))],
			Seq:         g.seqBase + seq + 1,
			Payload:     g.amounts[(r>>32)%maxAmount],
		}
		g.ptrs[k] = &g.msgs[k]
	}
	return g.ptrs[:n]
}

// appendPadded appends n in decimal, zero-padded to width digits, so that
// IDs sort in sequence order.
func appendPadded(b []byte, n int64, width int) []byte {
	var d [20]byte
	s := strconv.AppendInt(d[:0], n, 10)
	for range width - len(s) {
		b = append(b, '0')
	}
	return append(b, s...)
}

// mix is the splitmix64 finaliser: a cheap, well-spread hash of the
// sequence number that picks the account and the amount.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// Decode returns the account and amount a benchmark message carries: the
// account in AggregateID, the amount in decimal in Payload.
func Decode(msg *idem.Message) (account string, amount int64, err error) {
	if msg.AggregateID == "" || len(msg.Payload) == 0 || len(msg.Payload) > 18 {
		return "", 0, fmt.Errorf("bench: message %q is not a benchmark credit", msg.ID)
	}
	for _, c := range msg.Payload {
		if c < '0' || c > '9' {
			return "", 0, fmt.Errorf("bench: message %q: payload %q is not a decimal amount", msg.ID, msg.Payload)
		}
		amount = amount*10 + int64(c-'0')
	}
	return msg.AggregateID, amount, nil
}

// Aggregate sums the amounts of msgs per account and returns the accounts
// in ascending order with their totals, the set a batch upserts. Sorted
// accounts make concurrent batches lock rows in one order.
func Aggregate(msgs []*idem.Message) (accounts []string, amounts []int64, err error) {
	sums := make(map[string]int64, len(msgs))
	for _, m := range msgs {
		a, n, err := Decode(m)
		if err != nil {
			return nil, nil, err
		}
		sums[a] += n
	}
	accounts = make([]string, 0, len(sums))
	for a := range sums {
		accounts = append(accounts, a)
	}
	slices.Sort(accounts)
	amounts = make([]int64, len(accounts))
	for i, a := range accounts {
		amounts[i] = sums[a]
	}
	return accounts, amounts, nil
}
