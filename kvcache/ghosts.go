package kvcache

// ghosts remembers the hashes of the last evicted blocks (as many as the pool has
// blocks) and when each went, counted in evictions: a prompt that would have hit
// one shows how much more cache would have paid.
type ghosts struct {
	ring []ghost // oldest at next once full
	next int
	when map[Hash]uint64
}

type ghost struct {
	hash Hash
	at   uint64
}

func newGhosts(n int) ghosts {
	return ghosts{ring: make([]ghost, 0, n), when: make(map[Hash]uint64, n)}
}

// add records h as evicted at eviction count at (at > 0), forgetting the oldest
// record beyond capacity.
func (g *ghosts) add(h Hash, at uint64) {
	if cap(g.ring) == 0 {
		return
	}
	if len(g.ring) < cap(g.ring) {
		g.ring = append(g.ring, ghost{h, at})
	} else {
		if old := g.ring[g.next]; g.when[old.hash] == old.at {
			delete(g.when, old.hash) // unless evicted again since: that record is newer
		}
		g.ring[g.next] = ghost{h, at}
		g.next = (g.next + 1) % cap(g.ring)
	}
	g.when[h] = at
}

// at is when h was evicted, if it is remembered.
func (g *ghosts) at(h Hash) (uint64, bool) {
	at, ok := g.when[h]
	return at, ok
}

// forget drops h (it is cached again).
func (g *ghosts) forget(h Hash) { delete(g.when, h) }
