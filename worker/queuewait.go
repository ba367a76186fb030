package worker

import (
	"math"
	"time"
)

// admitAlpha is the EWMA weight of one admission interval. Lockstep ranks
// admit in batches (a whole batch finishes in one step), so intervals come
// as a few long gaps among zeros; 1/16 averages over about two batches of
// the default 8 rows and still follows a change of load within a second
// at the rates of a busy worker.
const admitAlpha = 1.0 / 16

// noteAdmittedLocked feeds QueueWait's estimate with one pass of admit that
// took popped requests off the queue at now, admitted of them live (the
// others' clients had left). Only a pass that follows one which left
// requests queued is a sample: its gap is the time the ranks took to make
// room, not time the worker sat idle.
func (s *Scheduler) noteAdmittedLocked(popped, admitted int, now time.Time) {
	if popped == 0 {
		return
	}
	if s.backlogged && admitted > 0 {
		per := now.Sub(s.lastAdmit).Seconds() / float64(admitted)
		if s.gapKnown {
			// admitted samples of per at once: the weight of as many EWMA steps.
			s.admitGap += (1 - math.Pow(1-admitAlpha, float64(admitted))) * (per - s.admitGap)
		} else {
			s.admitGap, s.gapKnown = per, true
		}
	}
	s.lastAdmit = now
	s.backlogged = len(s.queue) > 0
}

// QueueWait estimates how long a request that joined the queue now would
// wait for admission: the requests ahead of it, plus itself, times the
// recent interval between admissions while requests were waiting (an EWMA,
// so it follows the load, whatever bounds it: rows, blocks or step time).
// It is 0 until requests have once had to wait. The API turns it into
// Retry-After when it refuses a request for a full queue.
func (s *Scheduler) QueueWait() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Duration(float64(len(s.queue)+1) * s.admitGap * float64(time.Second))
}
