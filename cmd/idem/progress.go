package main

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/term"
)

// progressInterval is the redraw period of the terminal progress bar.
const progressInterval = 100 * time.Millisecond

// progressBarWidth is the number of cells in the terminal progress bar.
const progressBarWidth = 30

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(interface{ Fd() uintptr })
	return ok && term.IsTerminal(int(f.Fd()))
}

// progress reports how many of total units are done. On a terminal it
// redraws one line in place at most every progressInterval; elsewhere (a
// pipe, a file, a test buffer) it prints a plain line at every tenth.
// Add is safe for concurrent use.
type progress struct {
	w     io.Writer
	unit  string
	total int64
	tty   bool
	start time.Time
	done  atomic.Int64

	mu         sync.Mutex // serialises writes to w and the fields below
	lastTenth  int64      // plain mode: the last tenth printed
	lastLen    int        // terminal mode: length of the line on screen
	stop, gone chan struct{}
}

// newProgress starts reporting on w; call Finish when the work ends.
func newProgress(w io.Writer, total int64, unit string) *progress {
	p := &progress{w: w, unit: unit, total: max(total, 1), tty: isTerminal(w), start: time.Now()}
	if p.tty {
		p.stop, p.gone = make(chan struct{}), make(chan struct{})
		go p.redrawLoop()
	}
	return p
}

// Add records n more units done.
func (p *progress) Add(n int) {
	d := p.done.Add(int64(n))
	if p.tty {
		return
	}
	tenth := min(d*10/p.total, 10)
	p.mu.Lock()
	defer p.mu.Unlock()
	if tenth > p.lastTenth {
		p.lastTenth = tenth
		fmt.Fprintf(p.w, "progress: %3d%%  %d/%d %s  %.1fs\n", tenth*10, d, p.total, p.unit, time.Since(p.start).Seconds())
	}
}

// Finish stops the redraw loop and leaves the cursor on a fresh line.
func (p *progress) Finish() {
	if !p.tty {
		return
	}
	close(p.stop)
	<-p.gone
	p.mu.Lock()
	defer p.mu.Unlock()
	p.draw()
	fmt.Fprintln(p.w)
}

// redrawLoop redraws the bar every progressInterval until Finish.
func (p *progress) redrawLoop() {
	defer close(p.gone)
	t := time.NewTicker(progressInterval)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			p.mu.Lock()
			p.draw()
			p.mu.Unlock()
		}
	}
}

// draw rewrites the terminal line. The caller holds p.mu.
func (p *progress) draw() {
	d := min(p.done.Load(), p.total)
	filled := int(d * progressBarWidth / p.total)
	elapsed := time.Since(p.start).Seconds()
	rate := 0.0
	if elapsed > 0 {
		rate = float64(d) / elapsed
	}
	line := fmt.Sprintf("[%s%s] %5.1f%%  %d/%d %s  %.0f/s  %.1fs",
		strings.Repeat("#", filled), strings.Repeat(".", progressBarWidth-filled),
		float64(d)*100/float64(p.total), d, p.total, p.unit, rate, elapsed)
	pad := max(p.lastLen-len(line), 0)
	p.lastLen = len(line)
	fmt.Fprintf(p.w, "\r%s%s", line, strings.Repeat(" ", pad))
}
