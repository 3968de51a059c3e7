package idemtest_test

import (
	"fmt"

	"github.com/idemhq/idem/idemtest"
)

// The suite checks final states against values computed from the unique
// intended events, never by folding the delivered (duplicated) stream.
func ExampleExpected() {
	events := idemtest.Events(100) // 100 unique credits over 50 accounts
	want := idemtest.Expected(events)
	fmt.Println(len(events), len(want), want["acct-00"]) // acct-00: events 0 and 50, amounts 1 + 51
	// Output: 100 50 52
}
