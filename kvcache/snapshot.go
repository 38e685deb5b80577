package kvcache

import (
	"maps"
	"slices"
	"sync/atomic"
)

// snapshots holds what a pool publishes for other goroutines: its counters and the
// set of resident block hashes, rebuilt only when that set changed.
type snapshots struct {
	stats   atomic.Pointer[Stats]
	summary atomic.Pointer[Summary]
	pubGen  uint64
}

// publish stores st and, when the resident set's generation moved, a sorted summary
// of the keys of index.
func publish[V any](s *snapshots, st Stats, index map[Hash]V) {
	s.stats.Store(&st)
	if s.pubGen != st.Generation {
		s.summary.Store(&Summary{Generation: st.Generation, Hashes: slices.Sorted(maps.Keys(index))})
		s.pubGen = st.Generation
	}
}

// Stats returns the last published counters. Any goroutine.
func (s *snapshots) Stats() Stats { return *s.stats.Load() }

// Summary returns the last published resident set. Any goroutine; do not modify.
func (s *snapshots) Summary() *Summary { return s.summary.Load() }
