package api

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
)

// LlamaSamplerFields are llama-server's samplers beyond OpenAI's and vLLM's,
// under its names and with its defaults: SillyTavern and other front ends of
// llama.cpp send them, on /completion as on the OpenAI endpoints, and
// llama-server takes them on all of them, as shoal does.
type LlamaSamplerFields struct {
	TopNSigma        *float64 `json:"top_n_sigma"`        // -1 or 0: off
	TypicalP         *float64 `json:"typical_p"`          // 1: off
	XTCProbability   *float64 `json:"xtc_probability"`    // 0: off
	XTCThreshold     *float64 `json:"xtc_threshold"`      // 0.1; above 0.5: off
	DynatempRange    *float64 `json:"dynatemp_range"`     // 0: off
	DynatempExponent *float64 `json:"dynatemp_exponent"`  // 1
	Mirostat         *int     `json:"mirostat"`           // 0: off, 1 or 2
	MirostatTau      *float64 `json:"mirostat_tau"`       // 5
	MirostatEta      *float64 `json:"mirostat_eta"`       // 0.1
	DryMultiplier    *float64 `json:"dry_multiplier"`     // 0: off
	DryBase          *float64 `json:"dry_base"`           // 1.75
	DryAllowedLength *int     `json:"dry_allowed_length"` // 2
	DryPenaltyLastN  *int     `json:"dry_penalty_last_n"` // -1: the whole sequence
	MinKeep          *int     `json:"min_keep"`           // top-p, min-p, typical-p and XTC keep at least this many; 0
	// DrySequenceBreakers are strings a repeat does not reach back past
	// (sample.DefaultBreakers: newline, colon, quote, asterisk).
	DrySequenceBreakers []string `json:"dry_sequence_breakers"`
	// Samplers is the request's own order of samplers, as llama-server's: an
	// array of names ("penalties", "dry", "top_n_sigma", "top_k", "typ_p",
	// "top_p", "min_p", "xtc", "temperature") or a string of their letters
	// ("edskypmxt"); names it does not know are left out, as llama-server
	// leaves them. Unset: shoal's order (sample.Params.Order).
	Samplers json.RawMessage `json:"samplers"`
}

// samplerNames are llama-server's names of its samplers in a request,
// samplerAltNames the other names its command line takes too, and
// samplerLetters their letters. llama.cpp's "infill" sampler (for
// fill-in-the-middle) is known and left out: shoal has none (noStage).
const noStage sample.Stage = 0

var (
	samplerNames = map[string]sample.Stage{
		"penalties": sample.StagePenalties, "dry": sample.StageDRY, "top_n_sigma": sample.StageTopNSigma, "top_k": sample.StageTopK,
		"typ_p": sample.StageTypicalP, "top_p": sample.StageTopP, "min_p": sample.StageMinP, "xtc": sample.StageXTC,
		"temperature": sample.StageTemperature, "infill": noStage,
	}
	samplerAltNames = map[string]sample.Stage{
		"top-k": sample.StageTopK, "top-p": sample.StageTopP, "top-n-sigma": sample.StageTopNSigma, "nucleus": sample.StageTopP,
		"typical-p": sample.StageTypicalP, "typical": sample.StageTypicalP, "typ-p": sample.StageTypicalP, "typ": sample.StageTypicalP,
		"min-p": sample.StageMinP, "temp": sample.StageTemperature,
	}
	samplerLetters = map[rune]sample.Stage{
		'e': sample.StagePenalties, 'd': sample.StageDRY, 's': sample.StageTopNSigma, 'k': sample.StageTopK, 'y': sample.StageTypicalP,
		'p': sample.StageTopP, 'm': sample.StageMinP, 'x': sample.StageXTC, 't': sample.StageTemperature, 'i': noStage,
	}
)

// SamplersFlag reads llama-server's --samplers, names separated by ';', as
// the "samplers" of requests; a name it does not know is an error.
func SamplersFlag(list string) (json.RawMessage, error) {
	var names []string
	for _, n := range strings.Split(list, ";") {
		st, ok := samplerNames[n]
		if !ok {
			if st, ok = samplerAltNames[n]; !ok {
				return nil, fmt.Errorf("sampler %q: want some of penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature", n)
			}
		}
		for canonical, s := range samplerNames { // requests take canonical names only
			if s == st && st != noStage {
				names = append(names, canonical)
			}
		}
	}
	return json.Marshal(names)
}

// SamplerOrder reads llama-server's "samplers": names or letters, those it
// does not know left out. The order is never nil.
func SamplerOrder(raw json.RawMessage) ([]sample.Stage, error) {
	order := []sample.Stage{}
	var letters string
	if json.Unmarshal(raw, &letters) == nil {
		for _, r := range letters {
			if st, ok := samplerLetters[r]; ok && st != noStage {
				order = append(order, st)
			}
		}
		return order, nil
	}
	var names []string
	if err := json.Unmarshal(raw, &names); err != nil {
		return nil, invalid("samplers", "samplers must be an array of sampler names or a string of their letters")
	}
	for _, n := range names {
		if st, ok := samplerNames[n]; ok && st != noStage {
			order = append(order, st)
		}
	}
	return order, nil
}

// Over is f with d's fields where f leaves them out.
func (f LlamaSamplerFields) Over(d LlamaSamplerFields) LlamaSamplerFields {
	f.TopNSigma = cmp.Or(f.TopNSigma, d.TopNSigma)
	f.TypicalP = cmp.Or(f.TypicalP, d.TypicalP)
	f.XTCProbability = cmp.Or(f.XTCProbability, d.XTCProbability)
	f.XTCThreshold = cmp.Or(f.XTCThreshold, d.XTCThreshold)
	f.DynatempRange = cmp.Or(f.DynatempRange, d.DynatempRange)
	f.DynatempExponent = cmp.Or(f.DynatempExponent, d.DynatempExponent)
	f.Mirostat = cmp.Or(f.Mirostat, d.Mirostat)
	f.MirostatTau = cmp.Or(f.MirostatTau, d.MirostatTau)
	f.MirostatEta = cmp.Or(f.MirostatEta, d.MirostatEta)
	f.DryMultiplier = cmp.Or(f.DryMultiplier, d.DryMultiplier)
	f.DryBase = cmp.Or(f.DryBase, d.DryBase)
	f.DryAllowedLength = cmp.Or(f.DryAllowedLength, d.DryAllowedLength)
	f.DryPenaltyLastN = cmp.Or(f.DryPenaltyLastN, d.DryPenaltyLastN)
	f.MinKeep = cmp.Or(f.MinKeep, d.MinKeep)
	if f.DrySequenceBreakers == nil {
		f.DrySequenceBreakers = d.DrySequenceBreakers
	}
	if !present(f.Samplers) {
		f.Samplers = d.Samplers
	}
	return f
}

// present reports whether a JSON value was given (not left out, not null).
func present(raw json.RawMessage) bool { return len(raw) > 0 && string(raw) != "null" }

// CheckLlamaSamplers checks a backend's defaults of llama-server's samplers
// (LlamaSampling), as a request's fields are checked, and lays their DRY
// sequence breakers over the vocabulary when it has one.
func (b *Backend) CheckLlamaSamplers() error {
	var sp sample.Params
	return b.llamaSamplers(&LlamaSamplerFields{}, &sp)
}

// llamaSamplers checks f and sets sp's llama-server samplers from it, with the
// backend's defaults (LlamaSampling), then llama-server's, for the fields it
// leaves out.
func (b *Backend) llamaSamplers(req *LlamaSamplerFields, sp *sample.Params) error {
	over := req.Over(b.LlamaSampling)
	f := &over
	num := func(v *float64, param string, lo, hi float64, def float64) (float32, error) {
		if v == nil {
			return float32(def), nil
		}
		switch {
		case (math.IsNaN(*v) || *v < lo) && hi == math.MaxFloat32 && lo == 0:
			return 0, invalid(param, "%s must not be negative, got %v", param, *v)
		case math.IsNaN(*v) || *v < lo || *v > hi:
			return 0, invalid(param, "%s must be between %v and %v, got %v", param, lo, hi, *v)
		}
		return float32(*v), nil
	}
	var err error
	set := func(dst *float32, v *float64, param string, lo, hi, def float64) {
		if err == nil {
			*dst, err = num(v, param, lo, hi, def)
		}
	}
	set(&sp.TopNSigma, f.TopNSigma, "top_n_sigma", -math.MaxFloat32, math.MaxFloat32, -1)
	set(&sp.TypicalP, f.TypicalP, "typical_p", 0, 1, 1)
	set(&sp.XTCProbability, f.XTCProbability, "xtc_probability", 0, 1, 0)
	set(&sp.XTCThreshold, f.XTCThreshold, "xtc_threshold", 0, math.MaxFloat32, 0.1) // above 0.5: off
	set(&sp.DynatempRange, f.DynatempRange, "dynatemp_range", 0, math.MaxFloat32, 0)
	set(&sp.DynatempExponent, f.DynatempExponent, "dynatemp_exponent", 0, math.MaxFloat32, 1)
	set(&sp.MirostatTau, f.MirostatTau, "mirostat_tau", 0, math.MaxFloat32, 5)
	set(&sp.MirostatEta, f.MirostatEta, "mirostat_eta", 0, math.MaxFloat32, 0.1)
	set(&sp.DRY.Multiplier, f.DryMultiplier, "dry_multiplier", 0, math.MaxFloat32, 0)
	set(&sp.DRY.Base, f.DryBase, "dry_base", 0, math.MaxFloat32, 1.75)
	if err != nil {
		return err
	}
	if sp.TypicalP == 0 {
		// llama.cpp's typical-p 0 keeps the single most typical token (the
		// sampler's 0 is off): any mass passes it.
		sp.TypicalP = math.SmallestNonzeroFloat32
	}
	if sp.DRY.Base < 1 {
		sp.DRY.Multiplier = 0 // llama.cpp's DRY is off below base 1
	}
	if present(f.Samplers) {
		if sp.Order, err = SamplerOrder(f.Samplers); err != nil {
			return err
		}
	}
	if n := f.MinKeep; n != nil {
		if *n < 0 {
			return invalid("min_keep", "min_keep must not be negative, got %d", *n)
		}
		sp.MinKeep = *n
	}
	if m := f.Mirostat; m != nil {
		if *m < 0 || *m > 2 {
			return invalid("mirostat", "mirostat must be 0 (off), 1 or 2, got %d", *m)
		}
		sp.Mirostat = *m
	}
	sp.DRY.AllowedLength, sp.DRY.LastN = 2, -1
	if n := f.DryAllowedLength; n != nil {
		if *n < 0 {
			return invalid("dry_allowed_length", "dry_allowed_length must not be negative, got %d", *n)
		}
		sp.DRY.AllowedLength = *n
	}
	if n := f.DryPenaltyLastN; n != nil {
		if *n < -1 {
			return invalid("dry_penalty_last_n", "dry_penalty_last_n must be -1 (the whole sequence), 0 (off) or more, got %d", *n)
		}
		sp.DRY.LastN = *n
	}
	if req.DrySequenceBreakers != nil && len(req.DrySequenceBreakers) == 0 {
		return invalid("dry_sequence_breakers", "dry_sequence_breakers must not be empty (leave it out for the defaults)")
	}
	if len(f.DrySequenceBreakers) > sample.MaxBreakers {
		return invalid("dry_sequence_breakers", "at most %d dry_sequence_breakers are allowed, got %d", sample.MaxBreakers, len(f.DrySequenceBreakers))
	}
	// Empty (not nil): none, as --dry-sequence-breaker none; empty strings
	// are left out, as llama.cpp leaves them.
	breakers := slices.DeleteFunc(slices.Clone(f.DrySequenceBreakers), func(s string) bool { return s == "" })
	if f.DrySequenceBreakers == nil {
		breakers = sample.DefaultBreakers
	}
	if sp.DRY.Multiplier > 0 && sp.DRY.LastN != 0 && len(breakers) > 0 && b.Vocab != nil {
		if sp.DRY.Breakers, err = b.breakers(breakers); err != nil {
			return invalid("dry_sequence_breakers", "dry_sequence_breakers: %v", err)
		}
	}
	return nil
}

// dryBreakers are a backend's DRY sequence breakers laid over its vocabulary,
// by list (most requests send llama-server's defaults or a front end's), and
// every token's text, read once. A list is laid out outside the lock, once:
// requests for lists already laid out never wait behind a new one.
type dryBreakers struct {
	piecesOnce sync.Once
	pieces     [][]byte
	piecesErr  error

	mu     sync.Mutex
	byList map[string]*breakerList
}

// breakerList is one list of breakers, laid out once.
type breakerList struct {
	once sync.Once
	br   *sample.Breakers
	err  error
}

// maxBreakerLists bounds the lists kept; past it one is dropped (never
// llama-server's defaults).
const maxBreakerLists = 64

var defaultBreakersKey = breakersKey(sample.DefaultBreakers)

// breakersKey names a list unambiguously (its strings may hold any byte).
func breakersKey(list []string) string {
	b, _ := json.Marshal(list)
	return string(b)
}

// breakers lays list over the vocabulary, or finds it laid out already.
func (b *Backend) breakers(list []string) (*sample.Breakers, error) {
	d := b.dry
	if d == nil { // a backend not set on a server (tests)
		d = &dryBreakers{}
	}
	key := breakersKey(list)
	d.mu.Lock()
	e, ok := d.byList[key]
	if !ok {
		if d.byList == nil {
			d.byList = map[string]*breakerList{}
		}
		if len(d.byList) >= maxBreakerLists {
			for k := range d.byList {
				if k != defaultBreakersKey {
					delete(d.byList, k)
					break
				}
			}
		}
		e = &breakerList{}
		d.byList[key] = e
	}
	d.mu.Unlock()
	e.once.Do(func() {
		d.piecesOnce.Do(func() {
			pieces := make([][]byte, b.Vocab.Size())
			for t := range pieces {
				// As llama.cpp's DRY reads them: control tokens as their text.
				s, err := b.Vocab.Detokenize([]engine.Token{engine.Token(t)}, false, true)
				if err != nil {
					d.piecesErr = fmt.Errorf("read token %d: %w", t, err)
					return
				}
				pieces[t] = []byte(s)
			}
			d.pieces = pieces
		})
		if e.err = d.piecesErr; e.err == nil {
			e.br, e.err = sample.NewBreakers(b.Vocab, d.pieces, list)
		}
	})
	return e.br, e.err
}
