package cluster

import "github.com/shoal-ai/shoal/kvcache"

// summary is what this node knows of a peer's cached blocks, pieced together from
// messages that may arrive out of order: deltas over UDP (publishLocal), a
// newcomer's whole summary over TCP (sendSummary) and push/pull's full states
// (MergeRemoteState), each stamped with the peer's cache generation when it was
// taken. Each block keeps the generation that last added or evicted it, so a
// message older than what is known of a block does not undo it (a late eviction
// would drop a block cached again since, a late addition restore one evicted
// since), while what it says of other blocks is still taken. The zero value is
// empty. Its owner locks it (Node.mu).
type summary struct {
	at    map[kvcache.Hash]uint64 // cached blocks: the generation that added each
	gone  map[kvcache.Hash]uint64 // evicted since floor: the generation that evicted each
	floor uint64                  // the generation of the last full state taken
}

func (s *summary) has(h kvcache.Hash) bool {
	_, ok := s.at[h]
	return ok
}

func (s *summary) len() int { return len(s.at) }

// add takes blocks the peer held at generation gen.
func (s *summary) add(gen uint64, hs []kvcache.Hash) {
	if gen < s.floor {
		return // the full state taken since holds it
	}
	if s.at == nil {
		s.at = make(map[kvcache.Hash]uint64, len(hs))
	}
	for _, h := range hs {
		if e, ok := s.gone[h]; ok {
			if e > gen {
				continue // evicted since
			}
			delete(s.gone, h)
		}
		if a, ok := s.at[h]; ok {
			s.at[h] = max(a, gen)
		} else if len(s.at) < maxSummary {
			s.at[h] = gen
		}
	}
}

// evict takes blocks the peer had evicted by generation gen.
func (s *summary) evict(gen uint64, hs []kvcache.Hash) {
	if gen < s.floor {
		return
	}
	for _, h := range hs {
		if a, ok := s.at[h]; ok {
			if a > gen {
				continue // cached again since
			}
			delete(s.at, h)
		}
		if s.gone == nil {
			s.gone = map[kvcache.Hash]uint64{}
		}
		if e, ok := s.gone[h]; ok || len(s.gone) < maxSummary {
			s.gone[h] = max(e, gen)
		}
	}
}

// replace takes the peer's full state at generation gen: every block it held then,
// and no other (but those added or evicted later stay so).
func (s *summary) replace(gen uint64, hs []kvcache.Hash) {
	if gen < s.floor {
		return
	}
	at := make(map[kvcache.Hash]uint64, len(hs))
	for _, h := range hs {
		if e, ok := s.gone[h]; !ok || e <= gen {
			at[h] = gen
		}
	}
	for h, a := range s.at {
		if a > gen {
			at[h] = a
		}
	}
	for h, e := range s.gone {
		if e <= gen {
			delete(s.gone, h) // a message older than floor is not taken
		}
	}
	s.at, s.floor = at, gen
}
