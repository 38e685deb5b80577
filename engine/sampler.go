package engine

// Sampler picks the next token of one sequence from a row of logits.
//
// Concurrency: not safe for concurrent use. Each sequence owns one Sampler, used only
// by the goroutine that owns the engine. Close is safe to call twice.
type Sampler interface {
	// Sample chooses a token from logits (a view valid only during the call; the
	// sampler must not keep it) and returns it with its log-probability and, when asked
	// for, the top alternatives. It does not record the token: call Accept.
	Sample(logits []float32) (Sampled, error)
	// Accept records a token of the sequence (prompt or generated) for repetition
	// penalties and advances the grammar, if any, past generated tokens.
	Accept(t Token, generated bool)
	Close() error
}

// Sampled is the outcome of one sampling step.
type Sampled struct {
	Token   Token
	Logprob float32     // log-probability of Token under the model's distribution (when asked for)
	Top     []TokenProb // the most likely tokens, most likely first (only when asked for)
}

// TokenScore is how likely the model found a given token (a prompt's, as vLLM's
// prompt_logprobs score them): its log-probability, its rank in the vocabulary (1:
// the most likely; tokens with equal logits share the better rank) and, when asked
// for, the most likely tokens in its place.
type TokenScore struct {
	Token   Token
	Logprob float32
	Rank    int
	Top     []TokenProb
}

// TokenProb is a token and its log-probability.
type TokenProb struct {
	Token   Token
	Logprob float32
}
