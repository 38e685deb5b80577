package sample

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/shoal-ai/shoal/engine"
)

// DRY ("don't repeat yourself", as llama-server and KoboldCpp apply it) penalises
// the tokens that would extend a run of text already seen earlier in the
// sequence: a token that would make a repeat of length n (n ≥ AllowedLength)
// loses Multiplier × Base^(n − AllowedLength) from its logit. Runs do not reach
// back across a sequence breaker (a newline, a quote: text after it may repeat
// freely), and a token that is itself a whole breaker is never penalised.
type DRY struct {
	Multiplier    float32 // 0: off
	Base          float32 // at least 1
	AllowedLength int     // repeats this long are free
	// LastN is how many recent tokens (prompt and output) are searched; -1: the
	// whole sequence, 0: off.
	LastN    int
	Breakers *Breakers // nil: none
}

func (d DRY) on() bool { return d.Multiplier > 0 && d.LastN != 0 }

func (d DRY) validate() error {
	switch {
	case d.Multiplier < 0 || isNaN(d.Multiplier) || math.IsInf(float64(d.Multiplier), 0):
		return fmt.Errorf("dry_multiplier %v must be >= 0", d.Multiplier)
	case !d.on():
		return nil
	case d.Base < 1 || isNaN(d.Base) || math.IsInf(float64(d.Base), 0):
		return fmt.Errorf("dry_base %v must be at least 1", d.Base)
	case d.AllowedLength < 0:
		return fmt.Errorf("dry_allowed_length %d must be >= 0", d.AllowedLength)
	case d.LastN < -1:
		return fmt.Errorf("dry_penalty_last_n %d must be >= -1", d.LastN)
	}
	return nil
}

// Limits on a request's sequence breakers, as llama.cpp's: longer breakers are
// cut to MaxBreakerBytes, and a breaker's tokens after its first to
// maxBreakerTail. MaxBreakers bounds the vocabulary scans one request costs.
const (
	MaxBreakers     = 32
	MaxBreakerBytes = 40
	maxBreakerTail  = 20
)

// DefaultBreakers are llama-server's default DRY sequence breakers.
var DefaultBreakers = []string{"\n", ":", "\"", "*"}

// Breakers are DRY's sequence breakers laid out in a model's tokens: for each
// token that can begin one, the tokens that must follow it to complete the
// breaker (none when the token's text holds the whole breaker). Read-only once
// made: samplers of many sequences share one.
type Breakers struct {
	tails map[engine.Token][][]engine.Token
}

// BreakerVocab is what NewBreakers reads of a model's vocabulary (engine.Vocab
// has it).
type BreakerVocab interface {
	Size() int
	Tokenize(text string, addSpecial, parseSpecial bool) ([]engine.Token, error)
}

// NewBreakers lays out breakers over a vocabulary whose tokens render as
// pieces[t] (control tokens as their text), as llama.cpp's DRY does: a token
// whose text contains a breaker is a breaker by itself; a token whose text ends
// with the start of a breaker begins one, completed by the tokens of the rest of
// the breaker. Each breaker costs a pass over the vocabulary.
func NewBreakers(v BreakerVocab, pieces [][]byte, breakers []string) (*Breakers, error) {
	if len(breakers) > MaxBreakers {
		return nil, fmt.Errorf("%d sequence breakers: at most %d", len(breakers), MaxBreakers)
	}
	b := &Breakers{tails: map[engine.Token][][]engine.Token{}}
	for _, br := range breakers {
		if br == "" {
			return nil, fmt.Errorf("a sequence breaker is empty")
		}
		if len(br) > MaxBreakerBytes {
			br = br[:MaxBreakerBytes]
		}
		for t, piece := range pieces {
			if err := b.add(v, engine.Token(t), string(piece), br); err != nil {
				return nil, err
			}
		}
	}
	return b, nil
}

// add records how token t's text (word) can begin breaker br.
func (b *Breakers) add(v BreakerVocab, t engine.Token, word, br string) error {
	if strings.Contains(word, br) {
		b.addTail(t, nil)
		return nil
	}
	// Every position from which the rest of word is a proper start of br.
	for pos := 0; pos < len(word); pos++ {
		rest := word[pos:]
		if len(rest) >= len(br) || !strings.HasPrefix(br, rest) {
			continue
		}
		tail, err := v.Tokenize(br[len(rest):], false, false)
		if err != nil {
			return fmt.Errorf("tokenize sequence breaker %q: %w", br, err)
		}
		if len(tail) > maxBreakerTail {
			tail = tail[:maxBreakerTail]
		}
		b.addTail(t, tail)
	}
	return nil
}

func (b *Breakers) addTail(t engine.Token, tail []engine.Token) {
	for _, have := range b.tails[t] {
		if slices.Equal(have, tail) {
			return
		}
	}
	b.tails[t] = append(b.tails[t], tail)
}

// BreakerTokens lays out breakers given as token sequences (a test's, or a
// client's that names tokens): each is a head token and the tokens after it.
func BreakerTokens(seqs ...[]engine.Token) *Breakers {
	b := &Breakers{tails: map[engine.Token][][]engine.Token{}}
	for _, s := range seqs {
		if len(s) > 0 {
			b.addTail(s[0], slices.Clone(s[1:]))
		}
	}
	return b
}

// single reports whether t is a whole breaker by itself.
func (b *Breakers) single(t engine.Token) bool {
	if b == nil {
		return false
	}
	for _, tail := range b.tails[t] {
		if len(tail) == 0 {
			return true
		}
	}
	return false
}

// dryState is one sequence's DRY: its recent tokens and the penalties they
// give, computed once per new token.
type dryState struct {
	d       DRY
	history []engine.Token // the sequence's tokens, oldest first (at most 2 × LastN kept)
	at      int            // tokens seen when penalties were computed; -1: never
	seen    int            // tokens seen
	z       []int          // scratch: repeat lengths
	rev     []engine.Token // scratch: the window, newest first
	longest map[engine.Token]int
	pen     map[engine.Token]float32
}

func newDRY(d DRY) *dryState {
	return &dryState{d: d, at: -1, longest: map[engine.Token]int{}, pen: map[engine.Token]float32{}}
}

func (s *dryState) accept(t engine.Token) {
	s.seen++
	s.history = append(s.history, t)
	if n := s.d.LastN; n > 0 && len(s.history)-n > n { // not 2*n: LastN may be near MaxInt
		s.history = append(s.history[:0], s.history[len(s.history)-n:]...)
	}
}

// window is the tokens searched for repeats, oldest first.
func (s *dryState) window() []engine.Token {
	if n := s.d.LastN; n > 0 && len(s.history) > n {
		return s.history[len(s.history)-n:]
	}
	return s.history
}

// apply subtracts the penalties from c, indexed by token id.
func (s *dryState) apply(c []engine.TokenLogit) {
	if s.at != s.seen {
		s.compute()
		s.at = s.seen
	}
	for t, p := range s.pen {
		if int(t) < len(c) {
			c[t].Logit -= p
		}
	}
}

// compute finds, for each token, the longest repeat it would extend, and its
// penalty (llama.cpp's DRY, after KoboldCpp's).
func (s *dryState) compute() {
	clear(s.pen)
	h := s.window()
	n := len(h)
	allowed := s.d.AllowedLength
	if n <= allowed {
		return
	}
	// rev[i] is the i-th token from the end.
	s.rev = slices.Grow(s.rev[:0], n)[:n]
	rev := s.rev
	for i, t := range h {
		rev[n-1-i] = t
	}

	// A repeat may not reach back past the latest sequence breaker: limit is
	// the number of tokens after it.
	limit := n
	if b := s.d.Breakers; b != nil {
	scan:
		for i := range n {
			tails := b.tails[rev[i]]
			longest := -1
			for _, tail := range tails {
				if len(tail) <= longest || len(tail) > i {
					continue
				}
				match := true
				for k, t := range tail {
					if rev[i-k-1] != t {
						match = false
						break
					}
				}
				if match {
					longest = len(tail)
				}
			}
			if longest >= 0 {
				limit = i - longest
				break scan
			}
		}
	}
	if limit < allowed {
		return
	}

	// z[k]: how many tokens before the k-th-from-last match the sequence's
	// last tokens (the Z-function of the reversed window), capped at limit.
	s.z = slices.Grow(s.z[:0], n)[:n]
	z := s.z
	z[0] = 0
	l, r := 0, 0 // the match [l, r) reaching furthest right so far
	for k := 1; k < n; k++ {
		m := 0
		if k < r {
			m = min(r-k, z[k-l])
		}
		for k+m < n && rev[m] == rev[k+m] {
			m++
		}
		z[k] = m
		if k+m > r {
			l, r = k, k+m
		}
	}
	// The token after a repeat of length m (m ≥ allowed) would extend it to
	// m+1; each token keeps its longest.
	longest := s.longest
	clear(longest)
	for k := 1; k < n; k++ {
		m := min(z[k], limit)
		if m < allowed {
			continue
		}
		if old, ok := longest[h[n-k]]; !ok || m > old {
			longest[h[n-k]] = m
		}
	}
	// Base^exp overflows float32 past log(MaxFloat32)/log(Base).
	maxExp := 0
	if s.d.Base > 1.000001 {
		maxExp = int(88.7228391 / math.Log(float64(s.d.Base)))
	}
	for t, m := range longest {
		if s.d.Breakers.single(t) {
			continue
		}
		e := m - allowed
		if maxExp > 0 && e > maxExp {
			e = maxExp
		}
		s.pen[t] = s.d.Multiplier * float32(math.Pow(float64(s.d.Base), float64(e)))
	}
}
