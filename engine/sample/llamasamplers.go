package sample

import (
	"cmp"
	"math"
	"slices"

	"github.com/shoal-ai/shoal/engine"
)

// llama-server's samplers beyond OpenAI's, with llama.cpp's meanings (its
// llama-sampling.cpp at the pinned commit): top-n-sigma, typical-p, XTC,
// dynamic temperature and Mirostat. DRY is in dry.go.

// topNSigma keeps the candidates (logits, all finite) within n standard
// deviations of the best logit.
func topNSigma(c []engine.TokenLogit, maxL float32, n float32) []engine.TokenLogit {
	var sum float64
	finite := 0
	for _, x := range c {
		if !math.IsInf(float64(x.Logit), -1) { // as llama.cpp: banned tokens do not count
			sum += float64(x.Logit)
			finite++
		}
	}
	if finite == 0 {
		return c
	}
	mean := sum / float64(finite)
	var acc float64
	for _, x := range c {
		if !math.IsInf(float64(x.Logit), -1) {
			d := float64(x.Logit) - mean
			acc += d * d
		}
	}
	floor := float64(maxL) - float64(n)*math.Sqrt(acc/float64(finite))
	m := 0
	for _, x := range c {
		if float64(x.Logit) >= floor {
			c[m] = x
			m++
		}
	}
	return c[:m]
}

// dynamicTemp is the temperature for candidates c (logits, more than one):
// between temp-span (not below 0) and temp+span, by the entropy of their
// distribution at temperature 1 over the largest it could be, raised to exp.
func dynamicTemp(c []engine.TokenLogit, maxL float32, temp, span, exp float64) float64 {
	lo, hi := max(0, temp-span), temp+span
	// H = log Σe − Σ e·(l − max) / Σe, with e = exp(l − max).
	var sum, dot float64
	for _, x := range c {
		d := float64(x.Logit) - float64(maxL)
		if d < -negligible {
			continue
		}
		e := expNeg(d)
		sum += e
		dot += e * d
	}
	h := math.Log(sum) - dot/sum
	norm := max(0, h/math.Log(float64(len(c))))
	return lo + (hi-lo)*math.Pow(norm, exp)
}

// typicalCand is a candidate of typical-p with its distance from the entropy.
type typicalCand struct {
	x     engine.TokenLogit
	score float64
}

// typicalP keeps the candidates (probabilities summing to sum) whose surprise
// is closest to the distribution's entropy, most typical first, until their
// mass passes p (locally typical sampling). Like topP it does not sort them
// all: it sums the mass per bucket of distance, keeps the buckets closer than
// the one where the mass passes p, and sorts only that one.
func (s *Sampler) typicalP(c []engine.TokenLogit, sum, p float64) ([]engine.TokenLogit, float64) {
	logSum := math.Log(sum)
	tc := s.typical[:0]
	var h float64
	for _, x := range c {
		lq := math.Log(float64(x.Logit)) - logSum
		if x.Logit > 0 { // 0 · log 0 is 0
			h -= float64(x.Logit) / sum * lq
		}
		tc = append(tc, typicalCand{x, lq})
	}
	s.typical = tc
	for i := range tc {
		tc[i].score = math.Abs(-tc[i].score - h)
	}
	keep := len(tc)
	if len(tc) <= topPHead {
		keep = closest(tc, 0, p, sum)
	} else {
		if s.mass == nil {
			s.mass = make([]float64, 1<<(31-massShift)) // positive floats only
		}
		clear(s.mass)
		bucket := func(t typicalCand) int { return int(math.Float32bits(float32(t.score)) >> massShift) }
		for _, t := range tc {
			s.mass[bucket(t)] += float64(t.x.Logit) / sum
		}
		var acc float64
		b := 0
		for ; b < len(s.mass) && acc+s.mass[b] <= p; b++ {
			acc += s.mass[b]
		}
		if b < len(s.mass) { // else rounding: p is the whole mass
			// tc[:i]: the closer buckets, all kept; tc[i:k]: bucket b.
			i := gather(tc, 0, func(t typicalCand) bool { return bucket(t) < b })
			k := gather(tc, i, func(t typicalCand) bool { return bucket(t) == b })
			keep = i + closest(tc[i:k], acc, p, sum)
		}
	}
	if keep < s.p.MinKeep && keep < len(tc) {
		// At least MinKeep, the most typical first.
		byDistance(tc)
		keep = min(len(tc), s.p.MinKeep)
	}
	var kept float64
	for i, t := range tc[:keep] {
		c[i] = t.x
		kept += float64(t.x.Logit)
	}
	return c[:keep], kept
}

// closest sorts candidates of typical-p by their distance and counts how many
// of them, most typical first, bring the mass from acc past p (all of them if
// it does not pass).
func closest(tc []typicalCand, acc, p, sum float64) int {
	byDistance(tc)
	for i, t := range tc {
		acc += float64(t.x.Logit) / sum
		if acc > p {
			return i + 1
		}
	}
	return len(tc)
}

// byDistance sorts candidates of typical-p most typical first (then by id).
func byDistance(tc []typicalCand) {
	slices.SortFunc(tc, func(a, b typicalCand) int {
		return cmp.Or(cmp.Compare(a.score, b.score), cmp.Compare(a.x.Token, b.x.Token))
	})
}

// minP keeps the candidates (probabilities) at least floor likely, or the
// request's MinKeep most likely when fewer are, and returns them with their sum.
func (s *Sampler) minP(c []engine.TokenLogit, floor float32) ([]engine.TokenLogit, float64) {
	n := 0
	for _, x := range c {
		if x.Logit >= floor {
			n++
		}
	}
	if n < s.p.MinKeep {
		return keepBest(c, s.p.MinKeep)
	}
	m := 0
	var sum float64
	for _, x := range c {
		if x.Logit >= floor {
			c[m] = x
			m++
			sum += float64(x.Logit)
		}
	}
	return c[:m], sum
}

// topPKeep is topP keeping at least the request's MinKeep most likely.
func (s *Sampler) topPKeep(c []engine.TokenLogit, target float64) ([]engine.TokenLogit, float64) {
	kept, sum := s.topP(c, target)
	if len(kept) < s.p.MinKeep && len(kept) < len(c) {
		return keepBest(c, s.p.MinKeep) // topP kept a prefix of c, reordered: c still holds them all
	}
	return kept, sum
}

// keepBest keeps c's k most likely candidates (probabilities; all when fewer)
// and returns them with their sum.
func keepBest(c []engine.TokenLogit, k int) ([]engine.TokenLogit, float64) {
	if k < len(c) {
		selectTop(c, k)
		c = c[:k]
	}
	return c, total(c)
}

// total is the sum of c's probabilities (Logit).
func total(c []engine.TokenLogit) float64 {
	var sum float64
	for _, x := range c {
		sum += float64(x.Logit)
	}
	return sum
}

// xtc removes, of the candidates at least threshold likely (probabilities
// summing to sum), all but the least likely, when there are two or more and
// at least minKeep candidates are left.
func xtc(c []engine.TokenLogit, sum, threshold float64, minKeep int) ([]engine.TokenLogit, float64) {
	floor := threshold * sum
	above, last := 0, -1
	for i, x := range c {
		if float64(x.Logit) >= floor {
			above++
			if last < 0 || worse(x, c[last]) {
				last = i
			}
		}
	}
	if above < 2 || len(c)-(above-1) < minKeep {
		return c, sum
	}
	keep := c[last]
	m := 0
	sum = 0
	for _, x := range c {
		if float64(x.Logit) < floor || x == keep {
			c[m] = x
			m++
			sum += float64(x.Logit)
		}
	}
	return c[:m], sum
}

// mirostatM is how many of the most likely tokens Mirostat 1 fits its Zipf
// exponent to (llama-server's).
const mirostatM = 100

// mirostat draws from c (logits, all finite) at the request's temperature,
// truncated as Mirostat's version asks so that the token's surprise nears tau
// bits, and sets muNext from the surprise of the token drawn. vocab is the
// vocabulary's size.
func (s *Sampler) mirostat(c []engine.TokenLogit, maxL float32, vocab int) engine.Token {
	temp := float64(s.p.Temperature)
	if temp <= 0 {
		// One candidate left, certain: no surprise.
		s.muNext = s.mu + float64(s.p.MirostatEta)*float64(s.p.MirostatTau)
		return c[best(c)].Token
	}
	c, sum := probabilities(c, maxL, temp)
	if s.p.Mirostat == 1 {
		c, sum = mirostat1(c, sum, s.mu, vocab)
	} else {
		c, sum = mirostat2(c, sum, s.mu)
	}
	i := s.pick(c, sum)
	surprise := -math.Log2(float64(c[i].Logit) / sum)
	s.muNext = s.mu - float64(s.p.MirostatEta)*(surprise-float64(s.p.MirostatTau))
	return c[i].Token
}

// mirostat1 keeps the k most likely candidates (probabilities summing to sum),
// k estimated from a Zipf law fitted to the most likely mirostatM so that the
// expected surprise is mu bits.
func mirostat1(c []engine.TokenLogit, sum, mu float64, vocab int) ([]engine.TokenLogit, float64) {
	if len(c) == 1 {
		return c, sum
	}
	m := min(mirostatM, len(c))
	selectTop(c, m)
	slices.SortFunc(c[:m], better)
	var tb, tt float64
	for i := 0; i < m-1; i++ {
		t := math.Log(float64(i+2) / float64(i+1))
		b := math.Log(float64(c[i].Logit) / float64(c[i+1].Logit))
		tb += t * b
		tt += t * t
	}
	sHat := tb / tt
	eps := sHat - 1
	k := math.Pow(eps*math.Pow(2, mu)/(1-math.Pow(float64(vocab), -eps)), 1/sHat)
	if eps == 0 { // the limit of the above
		k = math.Pow(2, mu) / math.Log(float64(vocab))
	}
	switch {
	case math.IsNaN(k) || k >= float64(len(c)):
		return c, sum // the whole distribution
	case k < 1:
		k = 1
	}
	kk := int(k)
	if kk > m {
		return keepBest(c, kk)
	}
	c = c[:kk] // c[:m] is sorted
	return c, total(c)
}

// mirostat2 keeps the candidates (probabilities summing to sum) whose surprise
// is at most mu bits, or the most likely when none is.
func mirostat2(c []engine.TokenLogit, sum, mu float64) ([]engine.TokenLogit, float64) {
	floor := sum * math.Exp2(-mu) // a surprise of mu bits
	kept := 0.0
	m := 0
	for _, x := range c {
		if float64(x.Logit) >= floor {
			c[m] = x
			m++
			kept += float64(x.Logit)
		}
	}
	if m == 0 {
		c[0] = c[best(c)] // nothing was moved
		return c[:1], float64(c[0].Logit)
	}
	return c[:m], kept
}

// Stage is one of llama-server's samplers, for a request's own order of them
// (Params.Order).
type Stage uint8

// The stages, under llama-server's names: penalties, dry, top_n_sigma,
// top_k, typ_p, top_p, min_p, xtc, temperature.
const (
	StagePenalties Stage = iota + 1
	StageDRY
	StageTopNSigma
	StageTopK
	StageTypicalP
	StageTopP
	StageMinP
	StageXTC
	StageTemperature
)

// drawInOrder runs the request's own order of truncations and temperature
// over c (finite logits) and draws.
func (s *Sampler) drawInOrder(c []engine.TokenLogit) (engine.Token, bool) {
	o := s.truncateInOrder(c)
	if len(o.c) == 0 {
		return 0, false
	}
	c, sum := o.probabilities()
	return c[s.pick(c, sum)].Token, true
}

// ordered is the candidates between the stages of a request's own order:
// logits, or probabilities summing to sum (relative: the best's may be 1).
// Consecutive truncations that read probabilities share one conversion.
type ordered struct {
	c     []engine.TokenLogit
	probs bool
	sum   float64
}

// toProbabilities turns logits into probabilities, keeping the unlikeliest
// too (unlike the package's probabilities: a temperature above 1 later may
// make them likely), all but those too unlikely for a float32 (e^-103 of the
// best), which no temperature a request may ask for makes drawable.
func (o *ordered) toProbabilities() {
	if o.probs {
		return
	}
	maxL := float64(o.c[best(o.c)].Logit)
	o.sum = 0
	m := 0
	for _, x := range o.c {
		d := float64(x.Logit) - maxL
		p := math.Exp(d)
		if d >= -negligible {
			p = expNeg(d)
		}
		if f := float32(p); f > 0 {
			o.c[m] = engine.TokenLogit{Token: x.Token, Logit: f}
			m++
			o.sum += float64(f)
		}
	}
	o.c = o.c[:m]
	o.probs = true
}

// toLogits turns probabilities back into logits (log-probabilities: the same
// distribution, at any later temperature).
func (o *ordered) toLogits() {
	if !o.probs {
		return
	}
	for i := range o.c {
		o.c[i].Logit = float32(math.Log(float64(o.c[i].Logit)))
	}
	o.probs = false
}

// probabilities are the candidates' probabilities for the draw, and their sum.
func (o *ordered) probabilities() ([]engine.TokenLogit, float64) {
	if o.probs {
		return o.c, o.sum
	}
	return probabilities(o.c, o.c[best(o.c)].Logit, 1)
}

// truncateInOrder runs the request's own order of truncations and temperature
// over c (finite logits), as llama.cpp's sampler chain does: each stage reads
// the probabilities of the logits the stages before it left.
func (s *Sampler) truncateInOrder(c []engine.TokenLogit) *ordered {
	o := &ordered{c: c}
	for _, st := range s.p.Order {
		if len(o.c) < 2 {
			break
		}
		switch st {
		case StageTopNSigma:
			if s.p.TopNSigma > 0 {
				o.toLogits()
				o.c = topNSigma(o.c, o.c[best(o.c)].Logit, s.p.TopNSigma)
			}
		case StageTopK:
			if k := s.p.TopK; k > 0 && k < len(o.c) {
				o.c, o.sum = keepBest(o.c, k) // logits or probabilities: the same k (sum read only of probabilities)
			}
		case StageTypicalP:
			if tp := s.p.TypicalP; tp > 0 && tp < 1 {
				o.toProbabilities()
				o.c, o.sum = s.typicalP(o.c, o.sum, float64(tp))
			}
		case StageTopP:
			if tp := float64(s.p.TopP); tp > 0 && tp < 1 {
				o.toProbabilities()
				o.c, o.sum = s.topPKeep(o.c, tp*o.sum)
			}
		case StageMinP:
			if s.p.MinP > 0 {
				o.toProbabilities()
				o.c, o.sum = s.minP(o.c, s.p.MinP*o.c[best(o.c)].Logit)
			}
		case StageXTC:
			if s.p.XTCProbability > 0 && s.p.XTCThreshold <= 0.5 && s.rng.Float64() <= float64(s.p.XTCProbability) {
				o.toProbabilities()
				o.c, o.sum = xtc(o.c, o.sum, float64(s.p.XTCThreshold), s.p.MinKeep)
			}
		case StageTemperature:
			o.toLogits()
			temp := float64(s.p.Temperature)
			if s.p.DynatempRange > 0 {
				temp = dynamicTemp(o.c, o.c[best(o.c)].Logit, temp, float64(s.p.DynatempRange), float64(s.p.DynatempExponent))
			}
			if temp <= 0 {
				o.c[0] = o.c[best(o.c)]
				o.c = o.c[:1]
				break
			}
			maxL := float64(o.c[best(o.c)].Logit) // shifted first: a small temperature must not overflow
			for i := range o.c {
				o.c[i].Logit = float32((float64(o.c[i].Logit) - maxL) / temp)
			}
		}
	}
	return o
}
