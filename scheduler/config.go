package scheduler

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/shoal-ai/shoal/kvcache"
)

// Defaults for a CPU or single-GPU node.
const (
	// DefaultMaxBatchTokens is the token budget of one step: large enough for a decode
	// row per running sequence plus a prefill chunk, small enough that a long prompt
	// cannot stall everyone else's next token for long (chunked prefill).
	DefaultMaxBatchTokens = 512
	// DefaultMaxRunning bounds concurrently decoding sequences.
	DefaultMaxRunning = 64
	// DefaultMaxWaiting bounds the queue; beyond it Submit fails with ErrQueueFull
	// (HTTP 429) instead of letting latency grow without bound.
	DefaultMaxWaiting = 1024
	// DefaultMaxTokens applies when a request leaves max_tokens unset; 0 (the
	// default) generates until end-of-generation or a full context, as vLLM,
	// llama-server and Ollama do.
	DefaultMaxTokens = 0
	// openReserve is the room beyond its prompt that admission keeps for a request
	// without a limit on its output: it is admitted when that fits, grows as it
	// generates, and is preempted and resumed by recompute when the pool runs out
	// (a request with a limit has its whole room kept at admission instead).
	openReserve = 256
	// rateHalfLife smooths the token rates in the Load snapshot.
	rateHalfLife = 2 * time.Second
	// A step measures the prefill speed when it computes at least minRateTokens
	// prompt tokens and prefillDominates times as many as it decodes.
	minRateTokens    = 16
	prefillDominates = 4
)

// Config configures a Scheduler.
type Config struct {
	MaxBatchTokens   int
	MaxRunning       int
	MaxWaiting       int
	DefaultMaxTokens int
	// MaxModelLen is the longest sequence (prompt plus output) one request may have,
	// as vLLM's max_model_len; 0: the model's trained context. The KV cells one
	// sequence may use cap it too.
	MaxModelLen int
	// KV is the block pool's configuration; Cells and MaxSeqs are filled in from the
	// engine by New when zero.
	KV kvcache.Config
	// SampleWorkers is how many goroutines sample a step's rows in parallel when the
	// engine is an engine.LogitsViewer (a draw over a 128k-token vocabulary costs
	// milliseconds at temperature > 0, so one goroutine caps a large batch); 0:
	// GOMAXPROCS, 1: every row on the scheduler's goroutine.
	SampleWorkers int
	// Spec is speculative decoding by n-gram lookup; off by default.
	Spec SpecConfig
	// Adapters are the ids of the LoRA adapters a request may run under
	// (Request.Adapter i is Adapters[i-1], engine.Batch.Adapter i). llama.cpp
	// applies an adapter to a whole forward pass, so a step computes the
	// sequences of one adapter (or of none), and the adapters with work take
	// turns, step by step. Each adapter's KV is cached apart, under its id.
	Adapters []string
}

// SpecConfig configures speculative decoding by n-gram lookup (vLLM's "ngram"
// method, prompt lookup decoding): a decoding sequence whose last tokens
// appeared earlier in its prompt or output proposes the tokens that followed
// them there, and one forward pass checks them all. Each token is still drawn
// from the model's own distribution, in turn, with the same draws: the output
// is the one without proposals (up to the last bits of the logits, which differ
// between batch shapes), only sooner when proposals are right, as when a model
// repeats code or text from its prompt.
type SpecConfig struct {
	// Tokens is the most tokens proposed per sequence and step (vLLM's
	// num_speculative_tokens); 0: off.
	Tokens int
	// NgramMax and NgramMin bound the tail matched, longest first (vLLM's
	// prompt_lookup_max and prompt_lookup_min).
	NgramMax, NgramMin int
	// MaxRunning: no proposals while more sequences than this decode; a full
	// batch has no time to spare for rows that may be thrown away.
	MaxRunning int
}

// Spec defaults, as vLLM's examples set prompt lookup.
const (
	DefaultSpecNgramMax   = 4
	DefaultSpecNgramMin   = 2
	DefaultSpecMaxRunning = 16
	// MaxSpecTokens bounds SpecConfig.Tokens.
	MaxSpecTokens = 32
	// specWindow bounds how far back a proposal is looked for.
	specWindow = 8192
	// specPause is how many steps a sequence whose single proposed token was
	// turned down proposes nothing.
	specPause = 16
)

// DefaultConfig returns the defaults above with prefix caching on.
func DefaultConfig() Config {
	return Config{
		MaxBatchTokens:   DefaultMaxBatchTokens,
		MaxRunning:       DefaultMaxRunning,
		MaxWaiting:       DefaultMaxWaiting,
		DefaultMaxTokens: DefaultMaxTokens,
		KV:               kvcache.DefaultConfig(),
		Spec:             SpecConfig{NgramMax: DefaultSpecNgramMax, NgramMin: DefaultSpecNgramMin, MaxRunning: DefaultSpecMaxRunning},
	}
}

// Validate rejects zero or negative limits.
func (c Config) Validate() error {
	switch {
	case c.MaxBatchTokens < 1:
		return fmt.Errorf("scheduler: max batch tokens %d must be positive", c.MaxBatchTokens)
	case c.MaxRunning < 1:
		return fmt.Errorf("scheduler: max running %d must be positive", c.MaxRunning)
	case c.MaxWaiting < 1:
		return fmt.Errorf("scheduler: max waiting %d must be positive", c.MaxWaiting)
	case c.DefaultMaxTokens < 0:
		return fmt.Errorf("scheduler: default max tokens %d must not be negative", c.DefaultMaxTokens)
	case c.MaxModelLen < 0:
		return fmt.Errorf("scheduler: max model length %d must not be negative", c.MaxModelLen)
	case c.SampleWorkers < 0:
		return fmt.Errorf("scheduler: sample workers %d must not be negative", c.SampleWorkers)
	case c.MaxBatchTokens < c.MaxRunning:
		return fmt.Errorf("scheduler: max batch tokens %d cannot hold a decode row for each of %d running sequences", c.MaxBatchTokens, c.MaxRunning)
	case c.Spec.Tokens < 0 || c.Spec.Tokens > MaxSpecTokens:
		return fmt.Errorf("scheduler: speculative tokens %d must be in [0, %d]", c.Spec.Tokens, MaxSpecTokens)
	case c.Spec.Tokens > 0 && (c.Spec.NgramMin < 1 || c.Spec.NgramMax < c.Spec.NgramMin):
		return fmt.Errorf("scheduler: speculative n-gram sizes %d..%d: want 1 <= min <= max", c.Spec.NgramMin, c.Spec.NgramMax)
	case c.Spec.MaxRunning < 0:
		return fmt.Errorf("scheduler: speculative max running %d must not be negative", c.Spec.MaxRunning)
	}
	for i, a := range c.Adapters {
		if a == "" || slices.Contains(c.Adapters[:i], a) || a == c.KV.Model {
			return fmt.Errorf("scheduler: adapter id %q: want ids that are not empty, repeated or the model's", a)
		}
	}
	return c.KV.ValidatePolicy()
}

// Errors Submit returns; the API maps them to HTTP status codes.
var (
	ErrQueueFull     = errors.New("scheduler: waiting queue is full")
	ErrPromptTooLong = errors.New("scheduler: prompt does not fit the context")
	ErrInvalid       = errors.New("scheduler: invalid request")
	ErrClosed        = errors.New("scheduler: shut down")
)
