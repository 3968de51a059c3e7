package idem

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestUncutDropsOnlyTheCut: a lease call's context ignores the stop's cut
// but keeps every other cancellation on the way (a hook's deadline, the
// caller's end), and inside it nothing counts as cut.
func TestUncutDropsOnlyTheCut(t *testing.T) {
	c := &deliveries{cuts: true, cfg: ConsumerConfig{StopGrace: 20 * time.Millisecond}}
	parent, cancelParent := context.WithCancel(context.Background())
	defer cancelParent()
	stop := make(chan struct{})
	ctx, release := c.cutOnStop(parent, stop)
	defer release()

	// A deadline set between the cut and the call reaches the call.
	hooked, cancelHook := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancelHook()
	u, done := uncut(hooked)
	select {
	case <-u.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the call's context ignored a deadline set on the way")
	}
	if !errors.Is(context.Cause(u), context.DeadlineExceeded) {
		t.Fatalf("cause %v; want the deadline", context.Cause(u))
	}
	done()

	// The cut does not.
	close(stop)
	<-ctx.Done()
	if !wasCut(ctx) {
		t.Fatalf("cause %v; want the cut", context.Cause(ctx))
	}
	u, done = uncut(ctx)
	defer done()
	select {
	case <-u.Done():
		t.Fatalf("the call's context ended with the cut: %v", context.Cause(u))
	case <-time.After(50 * time.Millisecond):
	}
	// Nothing inside the call is under the cut: a nested processor's
	// writes are not bounded by it, and no second cut is made.
	if _, ok := cutGrace(u); ok {
		t.Fatal("the cut's grace is visible inside the call")
	}
	if inner, _ := c.cutOnStop(u, stop); inner != u {
		t.Fatal("a second cut was made inside the call")
	}
	wctx := context.WithoutCancel(u)
	if got, _ := cutWriteContext(u, wctx); got != wctx {
		t.Fatal("a write inside the call is bounded by the outer cut")
	}
	// The caller's end still reaches it.
	cancelParent()
	select {
	case <-u.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the call's context ignored its caller's end")
	}
}
