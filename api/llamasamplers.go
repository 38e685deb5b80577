package api

import (
	"fmt"
	"math"
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
	// DrySequenceBreakers are strings a repeat does not reach back past
	// (sample.DefaultBreakers: newline, colon, quote, asterisk).
	DrySequenceBreakers []string `json:"dry_sequence_breakers"`
}

// llamaSamplers checks f and sets sp's llama-server samplers from it, with
// llama-server's defaults for the fields it leaves out.
func (b *Backend) llamaSamplers(f *LlamaSamplerFields, sp *sample.Params) error {
	num := func(v *float64, param string, lo, hi float64, def float64) (float32, error) {
		if v == nil {
			return float32(def), nil
		}
		if math.IsNaN(*v) || *v < lo || *v > hi {
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
	set(&sp.XTCThreshold, f.XTCThreshold, "xtc_threshold", 0, 1, 0.1)
	set(&sp.DynatempRange, f.DynatempRange, "dynatemp_range", 0, math.MaxFloat32, 0)
	set(&sp.DynatempExponent, f.DynatempExponent, "dynatemp_exponent", 0, math.MaxFloat32, 1)
	set(&sp.MirostatTau, f.MirostatTau, "mirostat_tau", 0, math.MaxFloat32, 5)
	set(&sp.MirostatEta, f.MirostatEta, "mirostat_eta", 0, math.MaxFloat32, 0.1)
	set(&sp.DRY.Multiplier, f.DryMultiplier, "dry_multiplier", 0, math.MaxFloat32, 0)
	set(&sp.DRY.Base, f.DryBase, "dry_base", 1, math.MaxFloat32, 1.75)
	if err != nil {
		return err
	}
	if f.TypicalP != nil && *f.TypicalP == 0 {
		return invalid("typical_p", "typical_p must be in (0, 1] (1: off), got 0")
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
	if f.DrySequenceBreakers != nil && len(f.DrySequenceBreakers) == 0 {
		return invalid("dry_sequence_breakers", "dry_sequence_breakers must not be empty (leave it out for the defaults)")
	}
	if sp.DRY.Multiplier > 0 && sp.DRY.LastN != 0 {
		breakers := f.DrySequenceBreakers
		if breakers == nil {
			breakers = sample.DefaultBreakers
		}
		if sp.DRY.Breakers, err = b.breakers(breakers); err != nil {
			return invalid("dry_sequence_breakers", "dry_sequence_breakers: %v", err)
		}
	}
	return nil
}

// dryBreakers are a backend's DRY sequence breakers laid over its vocabulary,
// by list (most requests send llama-server's defaults or a front end's), and
// every token's text, read once.
type dryBreakers struct {
	mu     sync.Mutex
	pieces [][]byte
	byList map[string]*sample.Breakers
}

// maxBreakerLists bounds the lists kept; past it the cache starts over.
const maxBreakerLists = 64

// breakers lays list over the vocabulary, or finds it laid out already.
func (b *Backend) breakers(list []string) (*sample.Breakers, error) {
	d := b.dry
	if d == nil { // a backend not set on a server (tests)
		d = &dryBreakers{}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	key := strings.Join(list, "\x00")
	if br, ok := d.byList[key]; ok {
		return br, nil
	}
	if d.pieces == nil {
		pieces := make([][]byte, b.Vocab.Size())
		for t := range pieces {
			// As llama.cpp's DRY reads them: control tokens as their text.
			s, err := b.Vocab.Detokenize([]engine.Token{engine.Token(t)}, false, true)
			if err != nil {
				return nil, fmt.Errorf("read token %d: %w", t, err)
			}
			pieces[t] = []byte(s)
		}
		d.pieces = pieces
	}
	br, err := sample.NewBreakers(b.Vocab, d.pieces, list)
	if err != nil {
		return nil, err
	}
	if d.byList == nil || len(d.byList) >= maxBreakerLists {
		d.byList = map[string]*sample.Breakers{}
	}
	d.byList[key] = br
	return br, nil
}
