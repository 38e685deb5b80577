package scheduler

import (
	"cmp"
	"fmt"
	"slices"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
)

// MaxChoices bounds n.
const MaxChoices = 16

// MaxStopBytes bounds a stop string: each step looks for the longest start of
// each one at the output's end, which costs the square of its length.
const MaxStopBytes = 1024

// Request is one generation request.
type Request struct {
	Prompt    []engine.Token
	MaxTokens int // 0: the configured default (none: until end-of-generation); generation also stops when the context is full
	Sampling  sample.Params
	// Grammar is GBNF constraining the output; empty for none.
	Grammar string
	// GrammarTriggers makes Grammar lazy (engine.Engine.NewGrammar): it applies
	// from the first of these to appear in the output.
	GrammarTriggers []engine.Trigger
	// Stop strings end a choice; the text before them is emitted, they are not
	// unless IncludeStop (vLLM's include_stop_str_in_output).
	Stop        []string
	IncludeStop bool
	// StopTokens end a choice when generated (vLLM's stop_token_ids); their text
	// is left out unless IncludeStop, as vLLM leaves it out.
	StopTokens []engine.Token
	// MinTokens: no end-of-generation token, stop token or stop string ends a
	// choice before it has this many tokens (vLLM's min_tokens).
	MinTokens int
	// IgnoreEOS keeps generating past end-of-generation tokens (benchmarks).
	IgnoreEOS bool
	// SpecialTokens renders control tokens in the output's text (vLLM's
	// skip_special_tokens: false); by default they render as nothing.
	SpecialTokens bool
	N             int // choices; 0 means 1
	Priority      int // lower first, as vLLM's priority (default 0; negative: urgent)
	// Deadline, if set, cancels the request when reached, waiting or running.
	Deadline time.Time
	// PromptLogprobs asks for the prompt's tokens scored by the model, each
	// given those before it (vLLM's prompt_logprobs; echo with logprobs on
	// OpenAI's completions): one EventPromptLogprobs before choice 0's first
	// token, with PromptTopLogprobs alternatives per token. Such a prompt is
	// computed whole, without the prefix cache, whose tokens have no logits.
	PromptLogprobs    bool
	PromptTopLogprobs int
	// Embed asks for the prompt's pooled embedding (EventEmbedding) instead of
	// generation; the engine must be a pooling one. The prompt is computed in one pass.
	Embed bool
	// NoCache computes the whole prompt rather than take a cached prefix of it
	// (llama-server's cache_prompt: false); its blocks are cached for others
	// as any request's are.
	NoCache bool
	// Adapter is the LoRA adapter the request runs under: i for
	// Config.Adapters[i-1], 0 for none.
	Adapter int
	// Media are the prompt's images, in order (engine.Projector): their
	// positions hold placeholder tokens, which the engine reads as the
	// images' embeddings. The prompt's last token is text.
	Media []engine.Media
}

// mediaRow is the embedding at prompt position p, a placeholder's.
func (r *Request) mediaRow(p int) []float32 {
	i, _ := slices.BinarySearchFunc(r.Media, p, func(m engine.Media, p int) int {
		return cmp.Compare(m.Pos+m.Len-1, p)
	})
	return r.Media[i].Row(p)
}

// position is where token p of r's sequence (its prompt, then its output)
// stands for the model: p itself, except after M-RoPE images
// (engine.Media.Cols), which span fewer positions than tokens. An M-RoPE
// image's rows share its first position, each at line y and column x of it;
// within is true for its rows but the first.
func (r *Request) position(p int) (pos, y, x engine.Pos, within bool) {
	return position(r.Media, p)
}

// position is Request.position for a sequence whose images are media.
func position(media []engine.Media, p int) (pos, y, x engine.Pos, within bool) {
	shift := 0
	for _, m := range media {
		if p < m.Pos {
			break
		}
		if i := p - m.Pos; i < m.Len && m.Cols > 0 {
			return engine.Pos(m.Pos - shift), engine.Pos(i / m.Cols), engine.Pos(i % m.Cols), i > 0
		}
		shift += m.Len - m.Positions()
	}
	return engine.Pos(p - shift), 0, 0, false
}

// mediaCut is to, or, when [from, to) would end within an image, the image's
// start: an image computed whole (engine.Capacity.WholeMedia) is never cut
// over steps. from itself is never within one. (An M-RoPE image is cut like
// text: a failed step requeues its sequences, which drops every cell of an
// image not yet cached whole, kvcache.Config.UncutMedia.)
func (r *Request) mediaCut(from, to int) int {
	for _, m := range r.Media {
		if m.Pos < to && to < m.Pos+m.Len && m.Pos >= from {
			return m.Pos
		}
	}
	return to
}

func (r *Request) validate(vocab, adapters, width int) error {
	if len(r.Prompt) == 0 {
		return fmt.Errorf("%w: empty prompt", ErrInvalid)
	}
	next := 0 // the first position after the media checked
	for k, m := range r.Media {
		switch {
		case m.Pos < next || m.Len < 1 || m.Pos+m.Len >= len(r.Prompt):
			return fmt.Errorf("%w: image %d at prompt positions [%d, %d): want them in order, apart, and text after the last", ErrInvalid, k, m.Pos, m.Pos+m.Len)
		case len(m.Embd) != m.Len*width:
			return fmt.Errorf("%w: image %d: %d values for %d rows of %d", ErrInvalid, k, len(m.Embd), m.Len, width)
		case m.Cols < 0 || m.Rows < 0 || (m.Cols > 0 || m.Rows > 0) && m.Cols*m.Rows != m.Len:
			return fmt.Errorf("%w: image %d: a grid of %d×%d for %d rows", ErrInvalid, k, m.Cols, m.Rows, m.Len)
		}
		next = m.Pos + m.Len
	}
	in := 0 // r.Media[in] is the first that does not end before position i
	for i, t := range r.Prompt {
		for in < len(r.Media) && r.Media[in].Pos+r.Media[in].Len <= i {
			in++
		}
		image := in < len(r.Media) && r.Media[in].Pos <= i
		if image != (t < 0) || !image && int(t) >= vocab {
			return fmt.Errorf("%w: prompt token %d at %d outside the vocabulary of %d (or an image's placeholder out of place)", ErrInvalid, t, i, vocab)
		}
	}
	if len(r.Media) > 0 && (r.PromptLogprobs || r.Embed) {
		return fmt.Errorf("%w: a prompt with images has no prompt logprobs nor embedding", ErrInvalid)
	}
	if r.Adapter < 0 || r.Adapter > adapters {
		return fmt.Errorf("%w: adapter %d: this scheduler has %d", ErrInvalid, r.Adapter, adapters)
	}
	if r.MaxTokens < 0 {
		return fmt.Errorf("%w: max_tokens %d must not be negative", ErrInvalid, r.MaxTokens)
	}
	if r.N < 0 || r.N > MaxChoices {
		return fmt.Errorf("%w: n %d must be in [1, %d]", ErrInvalid, r.N, MaxChoices)
	}
	for _, s := range r.Stop {
		if s == "" || len(s) > MaxStopBytes {
			return fmt.Errorf("%w: a stop string of %d bytes: want 1 to %d", ErrInvalid, len(s), MaxStopBytes)
		}
	}
	for _, t := range r.StopTokens {
		if t < 0 || int(t) >= vocab {
			return fmt.Errorf("%w: stop token %d outside the vocabulary of %d", ErrInvalid, t, vocab)
		}
	}
	if r.MinTokens < 0 || r.MaxTokens > 0 && r.MinTokens > r.MaxTokens {
		return fmt.Errorf("%w: min_tokens %d must be in [0, max_tokens %d]", ErrInvalid, r.MinTokens, r.MaxTokens)
	}
	if r.PromptTopLogprobs < 0 || r.PromptTopLogprobs > sample.MaxTopLogprobs {
		return fmt.Errorf("%w: prompt top logprobs %d must be in [0, %d]", ErrInvalid, r.PromptTopLogprobs, sample.MaxTopLogprobs)
	}
	if r.Embed && (r.N > 1 || r.Grammar != "" || r.PromptLogprobs) {
		return fmt.Errorf("%w: an embedding request has one result, no grammar and no prompt logprobs", ErrInvalid)
	}
	if err := r.Sampling.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}
