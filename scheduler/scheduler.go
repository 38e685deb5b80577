package scheduler

import (
	"cmp"
	"container/heap"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
	"github.com/shoal-ai/shoal/kvcache"
)

// Load is a snapshot of the scheduler's state, published after every step.
type Load struct {
	Waiting        int
	MaxWaiting     int // Config.MaxWaiting: beyond it Submit fails with ErrQueueFull
	MaxBatchTokens int // Config.MaxBatchTokens: the longest embedding input Submit takes
	MaxRunning     int // Config.MaxRunning: sequences decoding at once
	Running        int
	KVBlocksUsed   int
	KVBlocksCached int
	KVCacheBudget  int // most cached blocks kept now (kvcache.Stats.CacheBudget)
	KVBlocksTotal  int
	KVBlockTokens  int
	// PrefillTokensPS is the smoothed prefill speed: prompt tokens per second in
	// steps that are mostly prefill (a step that decodes a batch and prefills a
	// short question says little about how fast a long prompt would go).
	PrefillTokensPS float64
	DecodeTokensPS  float64 // smoothed generated tokens per second of stepping
	// FinishPS is the smoothed number of sequences leaving the running batch per
	// second of stepping: how fast a slot frees when every slot is taken.
	FinishPS float64
	// QueueWait estimates how long a request arriving now waits before it starts:
	// the prefill queued ahead of it, or, when every running slot is taken, the
	// time until enough sequences finish to free one for it, whichever is longer.
	QueueWait       time.Duration
	PendingTokens   int    // prompt tokens still to prefill: queued (uncached) and running
	PrefixQueries   uint64 // prompt tokens looked up in the prefix cache
	PrefixHits      uint64 // of which found
	Steps           uint64
	PromptTokens    uint64 // prompt tokens of requests whose prompt was computed, cached ones included
	ComputedTokens  uint64 // prompt tokens computed (cache hits excluded; recomputes included)
	GeneratedTokens uint64
	// SpecProposed and SpecAccepted count the tokens speculative decoding
	// proposed and the model drew the same (Config.Spec).
	SpecProposed, SpecAccepted uint64
	// SpecDrafts counts proposals (a sequence's tokens proposed in one step),
	// SpecAcceptedAt[j] the proposals whose token j (from 0) the model drew the
	// same, for j below SpecTokens (Config.Spec.Tokens; 0: off).
	SpecDrafts     uint64
	SpecAcceptedAt [MaxSpecTokens]uint64
	SpecTokens     int
	Preemptions    uint64
	// StepTokens counts forward passes by the tokens they computed (prompt
	// chunks, decode rows and proposals): StepTokens[i] those of at most
	// StepTokenBounds[i] tokens and above the bound before it, the last those
	// above every bound. StepTokensSum is the tokens of them all.
	StepTokens      [len(StepTokenBounds) + 1]uint64
	StepTokensSum   uint64
	CacheGeneration uint64
	UpdatedAt       time.Time
	// AdapterRunning and AdapterWaiting count the sequences running and
	// waiting under each LoRA adapter (index i: Config.Adapters[i]); nil
	// without adapters.
	AdapterRunning, AdapterWaiting []int
}

// StepTokenBounds are the upper bounds of Load.StepTokens' buckets (vLLM's for
// its vllm:iteration_tokens_total histogram).
var StepTokenBounds = [...]int{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}

// countStep adds a forward pass of n tokens to l's StepTokens.
func (l *Load) countStep(n int) {
	i, _ := slices.BinarySearch(StepTokenBounds[:], n)
	l.StepTokens[i]++
	l.StepTokensSum += uint64(n)
}

// Scheduler runs continuous batching over one engine. Submit and Load may be called
// from any goroutine; Run is the single goroutine that owns the engine and the pool.
type Scheduler struct {
	cfg   Config
	eng   engine.Engine
	vocab engine.Vocab
	pool  kvcache.Allocator
	cap   engine.Capacity
	width int // the model's embedding width: an image row's (Request.Media)
	log   *slog.Logger

	mu      sync.Mutex
	inbox   []*group
	resets  []chan resetResult // ResetPrefixCache's callers, answered between steps
	closed  bool
	wake    chan struct{}
	waiting atomic.Int64 // inbox + queue, for ErrQueueFull without locking the loop
	load    atomic.Pointer[Load]

	// owned by Run
	queue    []*seq // waiting, ordered by (priority asc, arrival asc)
	running  []*seq
	arrival  uint64
	batch    engine.Batch
	rows     []*seq // rows[i]: the sequence whose output row i of the batch is, or nil
	building bool   // the batch is being built: rows may still be removed
	// runCap bounds the running sequences below MaxRunning after the engine could
	// not place a batch (ErrNoKVSpace: its cells fragmented): halved on each such
	// failure, a quarter more after every capRecoverSteps successful steps (0: no
	// bound). capSteps counts those steps.
	runCap, capSteps int
	decodeRows       int  // rows of this step that decode a generated token
	draftTokens      int  // rows of this step that check a proposed token
	stepAccepted     int  // proposals of this step the model drew the same
	specPause        int  // steps without proposals after a batch with them did not fit
	adapter          int  // the LoRA adapter of the last step (Config.Adapters)
	mediaWait        bool // this step, a running prompt's whole image did not fit: no admissions
	// placed are the images placed by M-RoPE (engine.Capacity.MRoPE) of
	// the sequences whose cells each KV sequence id holds, running or
	// cached (their embeddings dropped): KV ranges go to the engine as
	// positions (position), not indices.
	placed    map[kvcache.SeqID][]engine.Media
	eog       []engine.Token // the vocabulary's end tokens, once listed (endTokens)
	ended     int            // sequences that left the running batch since the last step
	endedAny  bool           // one has: the finish rate is measured, not predicted
	stats     Load
	prefillPS rate // feeds stats.PrefillTokensPS, and so on
	decodePS  rate
	finishPS  rate
}

// group is one request and its n choices.
type group struct {
	req      *Request
	ctx      context.Context
	stream   *Stream
	seqs     []*seq
	open     int // choices not finished yet
	usage    Usage
	failed   bool
	enqueued time.Time
}

// seq is one choice of a request.
type seq struct {
	g        *group
	index    int
	arrival  uint64
	tokens   []engine.Token // prompt + generated: what a resume recomputes
	kv       *kvcache.Seq
	sampler  engine.Sampler
	detok    engine.Detokenizer
	held     string // text held back because it may start a stop string
	gen      int
	maxNew   int
	open     bool // no limit was asked for: maxNew is the whole context (see openReserve)
	forkFrom *seq // n > 1: fork from this sequence once its prompt is computed
	running  bool
	done     bool
	// suspended: preempted (or its step undone); it resumes from its own blocks.
	suspended bool
	// decoding: its decode row is counted in this step's decodeRows.
	decoding bool
	// firstStart: the first admission sets the request's cached-token usage.
	firstStart bool
	uncached   int // prompt tokens not cached when it was queued
	// sampleRow is the batch row whose logits give this sequence's next token.
	sampleRow int
	committed int // tokens decoded into its cells (computed() counts this step's too)
	// scores holds the prompt's token scores computed so far when the request
	// asked for them (Request.PromptLogprobs): scores[i] is prompt token i+1's.
	// scored: they were sent.
	scores []engine.TokenScore
	scored bool
	// draft holds the tokens proposed this step after its decode row
	// (Config.Spec), at batch rows draftRows and positions from draftAt on.
	draft     []engine.Token
	draftRows []int
	draftAt   int
	// draftMax is how many tokens it proposes next (up to Config.Spec.Tokens):
	// halved when none of a proposal was taken, doubled when all were; when a
	// single token is turned down, it proposes nothing for draftPause steps.
	draftMax, draftPause int
	// draftOK, from its decode until its proposals are checked, is how many of
	// its positions hold tokens now certain: what keepVerified commits if it
	// ends (finish, fail) amid them.
	draftOK int
}

// scoring reports whether q still computes scores of its prompt's tokens.
func (s *seq) scoring() bool {
	return s.index == 0 && s.g.req.PromptLogprobs && !s.scored
}

// reserve is the room beyond its tokens that q needs kept free to be admitted:
// generation stops at max_tokens or when the context is full, whichever first, and
// a request without a limit reserves only openReserve of that.
func (s *seq) reserve(maxContext int) int {
	need := s.room(maxContext)
	if s.open {
		need = min(need, openReserve)
	}
	return max(need, 0)
}

// room is how many tokens q may still generate: to max_tokens, or until the
// context is full, whichever is first.
func (s *seq) room(maxContext int) int { return min(s.maxNew-s.gen, maxContext-len(s.tokens)) }

func (s *seq) computed() int {
	if s.kv == nil {
		return 0
	}
	return s.kv.Len()
}

// New returns a scheduler over eng. Run must be started for requests to progress.
func New(cfg Config, eng engine.Engine, log *slog.Logger) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := eng.Capacity()
	if cfg.MaxBatchTokens > c.BatchTokens {
		return nil, fmt.Errorf("scheduler: max batch tokens %d exceeds the engine's batch of %d", cfg.MaxBatchTokens, c.BatchTokens)
	}
	if cfg.KV.Cells == 0 {
		cfg.KV.Cells = c.Cells
	}
	if cfg.KV.MaxSeqs == 0 {
		cfg.KV.MaxSeqs = c.MaxSeqs
	}
	if cfg.KV.MaxSeqs > c.MaxSeqs || cfg.KV.Cells > c.Cells {
		return nil, fmt.Errorf("scheduler: a pool of %d cells for %d sequences exceeds the engine's %d cells and %d sequences", cfg.KV.Cells, cfg.KV.MaxSeqs, c.Cells, c.MaxSeqs)
	}
	if cfg.MaxRunning > cfg.KV.MaxSeqs {
		return nil, fmt.Errorf("scheduler: max running %d exceeds the engine's %d sequences", cfg.MaxRunning, cfg.KV.MaxSeqs)
	}
	if !c.PrefixReuse {
		cfg.KV.Caching = false // every sequence computes its own prompt
		if cfg.Spec.Tokens > 0 {
			// Recurrent and hybrid memory cannot be cut back past turned-down
			// proposals (llama.cpp refuses it), and sliding-window memory
			// reports the same: no proposals.
			cfg.Spec.Tokens = 0
			if log != nil {
				log.Warn("speculative decoding is off: this model's memory cannot be cut back past turned-down proposals")
			}
		}
	}
	// An M-RoPE image's cells share one position: never cut at a block's
	// edge.
	cfg.KV.UncutMedia = c.MRoPE
	if cfg.MaxModelLen == 0 {
		cfg.MaxModelLen = eng.Info().TrainedContext // 0 when unknown: the cells cap it
	}
	if cfg.KV.WeightCells == 0 && c.CellBytes > 0 {
		cfg.KV.WeightCells = int(float64(eng.Info().SizeBytes) / c.CellBytes)
	}
	var pool kvcache.Allocator
	var err error
	if c.Unified {
		pool, err = kvcache.New(cfg.KV)
	} else {
		// One stream per sequence: prefixes are reused by copying whole streams.
		pool, err = kvcache.NewSplit(cfg.KV, c.CellsPerSeq)
	}
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	s := &Scheduler{cfg: cfg, eng: eng, vocab: eng.Vocab(), pool: pool, cap: c, width: cmp.Or(c.MediaWidth, eng.Info().EmbeddingSize), log: log, wake: make(chan struct{}, 1)}
	s.publish()
	return s, nil
}

// Pool exposes the block pool; only its thread-safe views (Stats, Summary) may be
// used outside the scheduler, for metrics and gossip.
func (s *Scheduler) Pool() kvcache.Allocator { return s.pool }

// Load returns the latest snapshot. Any goroutine.
func (s *Scheduler) Load() Load { return *s.load.Load() }

// MaxContext is the longest sequence (prompt + generated) one request may have:
// Config.MaxModelLen, or less where the KV cache gives one sequence less.
func (s *Scheduler) MaxContext() int {
	// In whole blocks: a split stream of 1,365 cells holds 85 blocks of 16.
	B := s.pool.BlockTokens()
	n := min(s.cap.CellsPerSeq/B*B, s.pool.TotalBlocks()*B)
	if s.cfg.MaxModelLen > 0 {
		n = min(n, s.cfg.MaxModelLen)
	}
	return n
}

// Submit queues req. The stream ends with EventDone or EventError; cancelling ctx
// cancels the request within one step, waiting or running.
func (s *Scheduler) Submit(ctx context.Context, req *Request) (*Stream, error) {
	if err := req.validate(s.vocab.Size(), len(s.cfg.Adapters), s.width); err != nil {
		return nil, err
	}
	if n := len(req.Prompt); n >= s.MaxContext() {
		return nil, fmt.Errorf("%w: %d prompt tokens, context holds %d", ErrPromptTooLong, n, s.MaxContext())
	}
	if req.Embed && len(req.Prompt) > s.cfg.MaxBatchTokens {
		return nil, fmt.Errorf("%w: an embedding input of %d tokens exceeds the step budget of %d (--max-batch-tokens)", ErrPromptTooLong, len(req.Prompt), s.cfg.MaxBatchTokens)
	}
	for k, m := range req.Media {
		if (m.Cols > 0) != s.cap.MRoPE {
			return nil, fmt.Errorf("%w: image %d: a grid of %d×%d for an engine that places images by M-RoPE: %v", ErrInvalid, k, m.Cols, m.Rows, s.cap.MRoPE)
		}
	}
	if s.cap.WholeMedia {
		most := min(s.cfg.MaxBatchTokens, max(s.cap.MicroBatchTokens, 1))
		for k, m := range req.Media {
			if m.Len > most {
				return nil, fmt.Errorf("%w: image %d is %d tokens, computed in one step and micro-batch of at most %d (--max-batch-tokens, --ubatch-size)", ErrPromptTooLong, k, m.Len, most)
			}
		}
	}
	n := max(req.N, 1)
	if n > s.cfg.MaxWaiting {
		return nil, fmt.Errorf("%w: %d sequences, more than the waiting queue holds (%d): never admitted", ErrInvalid, n, s.cfg.MaxWaiting)
	}
	if s.waiting.Add(int64(n)) > int64(s.cfg.MaxWaiting) {
		s.waiting.Add(-int64(n))
		return nil, ErrQueueFull
	}
	g := &group{req: req, ctx: ctx, stream: newStream(s.signal), open: n, enqueued: time.Now()}
	g.usage.PromptTokens = len(req.Prompt)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.waiting.Add(-int64(n))
		return nil, ErrClosed
	}
	s.inbox = append(s.inbox, g)
	s.mu.Unlock()
	s.signal()
	return g.stream, nil
}

func (s *Scheduler) signal() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Run is the scheduling loop; it returns when ctx ends, after failing every request
// still queued or running with ErrClosed. Call it once.
func (s *Scheduler) Run(ctx context.Context) error {
	defer s.shutdown()
	for {
		s.takeInbox()
		s.takeResets()
		if len(s.queue) == 0 && len(s.running) == 0 {
			s.publish()
			select {
			case <-ctx.Done():
				return nil
			case <-s.wake:
			}
			continue
		}
		if ctx.Err() != nil {
			return nil
		}
		s.step(ctx)
	}
}

// ResetPrefixCache drops every cached prefix no running sequence uses (vLLM's
// reset_prefix_cache; kvcache.Allocator.DropCached), between two steps, and
// returns the blocks dropped. Safe from any goroutine.
func (s *Scheduler) ResetPrefixCache(ctx context.Context) (int, error) {
	done := make(chan resetResult, 1)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return 0, ErrClosed
	}
	s.resets = append(s.resets, done)
	s.mu.Unlock()
	s.signal()
	select {
	case r, ok := <-done:
		if !ok {
			return 0, ErrClosed
		}
		return r.blocks, r.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// resetResult is a reset's answer: the blocks dropped, or why it failed.
type resetResult struct {
	blocks int
	err    error
}

// takeResets answers ResetPrefixCache's callers.
func (s *Scheduler) takeResets() {
	s.mu.Lock()
	resets := s.resets
	s.resets = nil
	s.mu.Unlock()
	if len(resets) == 0 {
		return
	}
	n, ops := s.pool.DropCached()
	r := resetResult{blocks: n}
	if err := s.apply(ops); err != nil {
		r.err = fmt.Errorf("reset prefix cache: apply KV ops: %w", err)
		s.failAll(r.err)
	}
	s.publish()
	s.log.Info("prefix cache reset", "blocks", n, "err", r.err)
	for _, done := range resets {
		done <- r
	}
}

func (s *Scheduler) shutdown() {
	s.mu.Lock()
	s.closed = true
	inbox := s.inbox
	s.inbox = nil
	for _, done := range s.resets {
		close(done)
	}
	s.resets = nil
	s.mu.Unlock()
	for _, g := range inbox {
		s.waiting.Add(-int64(g.open))
		g.stream.push(Event{Kind: EventError, Err: ErrClosed})
	}
	for _, q := range slices.Concat(s.queue, s.running) {
		s.fail(q.g, ErrClosed)
	}
	s.queue, s.running = nil, nil
	s.publish()
}

func (s *Scheduler) takeInbox() {
	s.mu.Lock()
	in := s.inbox
	s.inbox = nil
	s.mu.Unlock()
	for _, g := range in {
		n := max(g.req.N, 1)
		maxNew, open := g.req.MaxTokens, false
		if maxNew == 0 {
			maxNew = s.cfg.DefaultMaxTokens
		}
		if maxNew == 0 {
			maxNew, open = s.MaxContext(), true // the context ends it
		}
		if g.req.Embed {
			maxNew, open = 0, false // nothing is generated
		}
		g.usage.MaxTokens = maxNew
		if open {
			g.usage.MaxTokens = max(maxNew-len(g.req.Prompt), 0)
		}
		for i := range n {
			s.arrival++
			q := &seq{g: g, index: i, arrival: s.arrival, tokens: slices.Clone(g.req.Prompt), maxNew: maxNew, open: open, firstStart: i == 0, sampleRow: -1}
			g.seqs = append(g.seqs, q)
			if i > 0 {
				q.forkFrom = g.seqs[0]
			}
		}
		// Choices after the first wait for the first's prompt and fork from it; only
		// the first is queued.
		s.enqueue(g.seqs[0])
	}
}

func (s *Scheduler) enqueue(q *seq) {
	q.sampleRow, q.decoding = -1, false // a row of a batch it is no longer in
	q.draft, q.draftRows = nil, nil
	// What it will cost to prefill, given the cache now: the queue-wait estimate that
	// routers read counts this, not the whole prompt.
	q.uncached = len(q.tokens) - s.pool.CachedPrefix(s.model(q), s.cachedPrompt(q))
	i, _ := slices.BinarySearchFunc(s.queue, q, queueOrder)
	s.queue = slices.Insert(s.queue, i, q)
}

// cachedPrompt is what q may take from the prefix cache: its prompt; nothing for
// a request that takes none (uncached); for a prompt being scored, the
// tokens whose following token is scored already (a cached token has no
// logits), and the next, which the pool always leaves to compute (its row
// scores the one after it): cut one shorter, a resume would not take back its
// last block computed, which would stay kept for it past the cache budget.
func (s *Scheduler) cachedPrompt(q *seq) []int32 {
	switch {
	case s.uncached(q):
		return nil
	case q.scoring():
		return toInt32(q.tokens[:min(len(q.scores)+1, len(q.tokens))])
	}
	return toInt32(q.tokens)
}

// uncached reports whether q takes nothing from the prefix cache: it asks so
// (Request.NoCache), or it is an embedding, pooled over its whole prompt in one
// pass (a cached prefix would leave the pooling only the tail), unless the
// engine pools the last token over causal attention (Capacity.PoolsLast).
func (s *Scheduler) uncached(q *seq) bool {
	return q.g.req.NoCache || q.g.req.Embed && !s.cap.PoolsLast
}

func queueOrder(a, b *seq) int {
	return cmp.Or(cmp.Compare(a.g.req.Priority, b.g.req.Priority), cmp.Compare(a.arrival, b.arrival))
}

// model is the id q's KV is cached under: its adapter's, or "" (the model's).
func (s *Scheduler) model(q *seq) string {
	if a := q.g.req.Adapter; a > 0 {
		return s.cfg.Adapters[a-1]
	}
	return ""
}

// stepAdapter picks the adapter whose sequences this step computes: the next
// after the last step's, in turn, that has a sequence running or near the
// queue's head (llama.cpp applies an adapter to a whole forward pass).
func (s *Scheduler) stepAdapter() int {
	n := len(s.cfg.Adapters) + 1
	if n == 1 {
		return 0
	}
	has := make([]bool, n)
	for _, q := range s.running {
		has[q.g.req.Adapter] = true
	}
	for _, q := range s.queue[:min(len(s.queue), maxPassedOver+1)] {
		has[q.g.req.Adapter] = true
	}
	for i := 1; i <= n; i++ {
		if a := (s.adapter + i) % n; has[a] {
			return a
		}
	}
	return s.adapter
}

// step runs one forward pass.
func (s *Scheduler) step(ctx context.Context) {
	s.dropCancelled()
	s.batch.Reset()
	s.adapter = s.stepAdapter()
	s.batch.Adapter = s.adapter
	s.rows = s.rows[:0]
	s.decodeRows, s.draftTokens, s.stepAccepted = 0, 0, 0
	s.mediaWait = false
	s.building = true
	for _, q := range s.running {
		q.sampleRow, q.decoding = -1, false
	}

	// 1. A decode row for every running sequence whose prompt is computed. Growing
	// may preempt others (including ones already in the batch), so iterate a copy.
	for _, q := range slices.Clone(s.running) {
		if !q.running || q.computed() < len(q.tokens)-1 || q.g.req.Adapter != s.adapter {
			continue
		}
		if s.grow(q, q.tokens[len(q.tokens)-1:]) {
			s.addRows(q, len(q.tokens)-1, len(q.tokens))
			if q.gen > 0 {
				s.decodeRows++
				q.decoding = true
			}
		}
	}
	// 2. Chunks of prompts already running.
	for _, q := range slices.Clone(s.running) {
		if s.budget() == 0 {
			break
		}
		if q.running && q.computed() < len(q.tokens)-1 && q.g.req.Adapter == s.adapter {
			s.prefill(q)
		}
	}
	// 3. Admit waiting requests while budget, sequence slots and KV allow. One
	// whose prompt starts with what a running sequence is computing waits for it
	// (see sharesInProgress); those behind it may go first.
	for i := 0; s.budget() > 0 && !s.mediaWait && i < min(len(s.queue), maxPassedOver+1) && len(s.running) < s.maxRunning(); {
		q := s.queue[i]
		if s.sharesInProgress(q) {
			i++ // it stays in the queue, in its place
			continue
		}
		need := q.reserve(s.MaxContext())
		prompt := s.cachedPrompt(q)
		if !s.pool.Fits(s.model(q), prompt, need+len(q.tokens)-len(prompt)) {
			if len(s.running) == 0 {
				// Nothing running will free more: the request can never fit.
				s.fail(q.g, fmt.Errorf("%w: %d tokens plus %d to generate exceed the KV pool", ErrPromptTooLong, len(q.tokens), need))
				continue
			}
			break
		}
		start := s.pool.Start
		if q.suspended {
			start = s.pool.Resume
		}
		kv, ops, err := start(s.model(q), prompt)
		if err != nil {
			break // no sequence id: wait for one to finish
		}
		s.place(kv.ID, q.g.req)
		if err := s.apply(ops); err != nil {
			// Its sequence's cells go too: copies applied before the failure must
			// not be read by the next sequence given its id.
			if rerr := s.apply(s.pool.Release(kv)); rerr != nil {
				s.log.Error("release a sequence whose start failed", "err", rerr)
			}
			s.building = false
			s.failAll(fmt.Errorf("apply KV ops: %w", err))
			return
		}
		s.queue = slices.Delete(s.queue, i, i+1)
		s.waiting.Add(-1)
		q.kv = kv
		q.running, q.suspended = true, false
		if q.gen == 0 && q.index == 0 && q.firstStart {
			q.g.usage.CachedTokens = kv.Cached()
			q.g.usage.QueueTime = time.Since(q.g.enqueued)
			q.g.stream.cached.Store(int64(q.g.usage.CachedTokens))
			q.g.stream.queued.Store(int64(q.g.usage.QueueTime))
			q.firstStart = false
		}
		s.running = append(s.running, q)
		if q.g.req.Adapter != s.adapter {
			// Admitted in its place in the queue, computed in its adapter's steps.
		} else if q.computed() < len(q.tokens)-1 {
			s.prefill(q)
		} else if s.grow(q, q.tokens[len(q.tokens)-1:]) {
			s.addRows(q, len(q.tokens)-1, len(q.tokens))
		}
	}
	// 4. Proposals, from what the budget has left (Config.Spec).
	s.propose()
	s.building = false
	if s.batch.Len() == 0 {
		if len(s.running) == 0 && len(s.queue) > 0 {
			// Blocked on a sequence id with nothing running to free one: cannot
			// happen while the pool's invariants hold; yield instead of spinning.
			time.Sleep(time.Millisecond)
		}
		s.publish()
		return
	}
	s.decode(ctx)
	s.publish()
}

// sharesInProgress reports whether a running sequence is still computing its prompt
// and shares with q's prompt a block or more beyond what the cache holds now.
// Admitted now, q would compute those tokens again in the same steps (a burst of
// requests with one new prefix computes it once per request); a step or a few later,
// once the other's blocks are committed, q finds them cached. The wait ends when the
// other's prompt is computed (or it leaves the batch), cached or not.
func (s *Scheduler) sharesInProgress(q *seq) bool {
	if !s.cfg.KV.Caching {
		return false
	}
	if q.gen > 0 || q.index > 0 || q.forkFrom != nil || s.uncached(q) || q.scoring() {
		return false // it does not read the cache
	}
	B := s.pool.BlockTokens()
	cached := -1
	for _, r := range s.running {
		if r.gen > 0 || r.index > 0 || r.committed >= len(r.tokens) || r.g.req.Adapter != q.g.req.Adapter {
			continue // not computing a prompt, or another adapter's KV
		}
		n := 0
		for n < min(len(q.tokens), len(r.tokens)-1) && q.tokens[n] == r.tokens[n] {
			n++
		}
		n = n / B * B // only whole blocks are shared
		if n < B {
			continue
		}
		if cached < 0 {
			cached = s.pool.CachedPrefix(s.model(q), toInt32(q.tokens))
		}
		if n >= cached+B {
			return true
		}
	}
	return false
}

// propose adds to the batch, after the decode rows of sequences decoding, the
// tokens that followed their last tokens where those appeared before in their
// prompt or output (Config.Spec), as far as the step's budget allows and the
// pool has room without preempting anyone. takeDrafts checks them.
func (s *Scheduler) propose() {
	sp := s.cfg.Spec
	if s.specPause > 0 {
		s.specPause--
		return
	}
	if sp.Tokens == 0 || s.decodeRows > sp.MaxRunning {
		return
	}
	for _, q := range s.running {
		if s.budget() == 0 {
			return
		}
		// A sequence decoding, or drawing its first token after its prompt
		// (only choice of its request: n > 1 forks from that row, and a
		// scored prompt's event comes first).
		first := q.gen == 0 && q.g.req.N <= 1 && !q.g.req.PromptLogprobs && !q.g.req.Embed
		if !q.running || !(q.decoding || first) || q.sampleRow < 0 {
			continue
		}
		if q.draftPause > 0 {
			q.draftPause--
			continue
		}
		// The decode row yields one token; proposals may add up to the rest.
		if q.draftMax == 0 {
			q.draftMax = sp.Tokens
		}
		room := min(q.draftMax, s.budget(), q.maxNew-q.gen-1, s.MaxContext()-len(q.tokens)-1)
		if room < 1 {
			continue
		}
		d := proposal(q.tokens, room, sp.NgramMax, sp.NgramMin)
		if i := slices.IndexFunc(d, func(t engine.Token) bool { return t < 0 }); i >= 0 {
			d = d[:i] // an image's placeholder is no token to generate
		}
		if len(d) == 0 {
			continue
		}
		if !s.pool.Spare(q.kv, len(d)) {
			continue // only from free cells: no cached block is evicted, nobody preempted, for them
		}
		ops, err := s.pool.Grow(q.kv, toInt32(d))
		if err != nil {
			continue
		}
		if err := s.apply(ops); err != nil {
			s.failAll(fmt.Errorf("apply KV ops: %w", err))
			return
		}
		q.draft, q.draftRows, q.draftAt = d, q.draftRows[:0], len(q.tokens)
		for j, t := range d {
			q.draftRows = append(q.draftRows, s.batch.Len())
			pos, _, _, _ := q.g.req.position(len(q.tokens) + j)
			s.batch.Add(t, pos, engine.SeqID(q.kv.ID), true)
			s.rows = append(s.rows, nil)
		}
		s.draftTokens += len(d)
		s.stats.SpecProposed += uint64(len(d))
		s.stats.SpecDrafts++
	}
}

// proposal returns up to k tokens that followed, in toks, the latest earlier
// occurrence of its last n tokens, for n from nmax down to nmin (within the last
// specWindow tokens), or nil.
func proposal(toks []engine.Token, k, nmax, nmin int) []engine.Token {
	L := len(toks)
	lo := max(0, L-specWindow)
	for n := min(nmax, L-1); n >= nmin; n-- {
		tail := toks[L-n:]
		for i := L - n - 1; i >= lo; i-- {
			if toks[i+n-1] == tail[n-1] && slices.Equal(toks[i:i+n], tail) {
				return slices.Clone(toks[i+n : min(i+n+k, L)])
			}
		}
	}
	return nil
}

// takeDrafts checks q's proposals against the model, in turn: first is the
// token its decode row drew; while it equals the next proposal, that
// proposal's row (computed with it) draws the token after it, from the model's
// distribution as any draw. The first that differs is the model's own next
// token, and the proposals after it are trimmed from the KV cache, which is
// committed then.
func (s *Scheduler) takeDrafts(q *seq, first engine.Token) {
	draft, rows := q.draft, q.draftRows
	q.draft = nil
	accepted, tok := 0, first
	for j, d := range draft {
		if !q.running || q.done || tok != d {
			break
		}
		if _, asked := q.g.stream.stopped(q.index); asked || q.g.ctx.Err() != nil {
			break // its reader ended it, or its client left: no more tokens than it must
		}
		s.stats.SpecAcceptedAt[accepted]++
		accepted++
		q.draftOK = q.draftAt + accepted
		var out engine.Sampled
		var serr error
		if err := s.eng.Logits(rows[j], func(l []float32) { out, serr = s.sampleSafely(q.sampler, l) }); err != nil {
			serr = err
		}
		s.emitSampled(q, out, serr)
		tok = out.Token
	}
	q.draftOK = 0
	s.stats.SpecAccepted += uint64(accepted)
	s.stepAccepted += accepted
	switch {
	case accepted == 0 && q.draftMax <= 1:
		q.draftPause = specPause // its text does not repeat now: stop checking for a while
	case accepted == 0: // rows that brought nothing: propose fewer
		q.draftMax = max(1, q.draftMax/2)
	case accepted == len(draft):
		q.draftMax = min(s.cfg.Spec.Tokens, 2*q.draftMax)
	}
	if q.kv == nil {
		return // it ended: its KV is released
	}
	ops, err := s.pool.Trim(q.kv, q.draftAt+accepted)
	if err == nil {
		err = s.apply(ops)
	}
	if err != nil {
		s.fail(q.g, fmt.Errorf("trim proposals: %w", err))
		return
	}
	if s.commit(q) {
		q.committed = q.computed()
	}
}

// commit makes q's computed full blocks shareable (kvcache.Allocator.Commit),
// applying what that changes in the engine's memory; false when that failed
// and q's request with it.
func (s *Scheduler) commit(q *seq) bool {
	if err := s.apply(s.pool.Commit(q.kv)); err != nil {
		s.fail(q.g, fmt.Errorf("commit KV blocks: %w", err))
		return false
	}
	return true
}

// maxPassedOver bounds how many waiting requests (each waiting for a prefix in
// progress) one admission pass looks past: each costs a comparison with the prompts
// being computed.
const maxPassedOver = 16

func (s *Scheduler) budget() int { return max(0, s.cfg.MaxBatchTokens-s.batch.Len()) }

// prefill adds as many of q's uncomputed tokens as the budget allows to the batch.
func (s *Scheduler) prefill(q *seq) {
	from := q.computed()
	// Resumed sequences recompute everything but their last token, which is then the
	// decode row (its logits produce the next token).
	end := len(q.tokens)
	if q.gen > 0 {
		end = len(q.tokens) - 1
	}
	to := min(end, from+s.budget())
	if q.g.req.Embed && to < end {
		return // a pooled sequence is computed in one pass: wait for a step with room
	}
	if s.cap.WholeMedia {
		if to = q.g.req.mediaCut(from, to); to <= from {
			// Its next image does not fit this step: admit no one more
			// until one has room (the decode rows drain as sequences end).
			s.mediaWait = true
		}
	}
	if to <= from {
		return
	}
	if s.grow(q, q.tokens[from:to]) {
		s.addRows(q, from, to)
	}
}

// addRows puts tokens [from, to) of q into the batch; the last prompt token (or the
// decode token) asks for logits, and so do the tokens before prompt tokens being
// scored (scorePrompts).
func (s *Scheduler) addRows(q *seq, from, to int) {
	q.sampleRow = -1
	scoring := q.scoring()
	for p := from; p < to; p++ {
		sample := p == len(q.tokens)-1 || q.g.req.Embed
		if sample {
			q.sampleRow = s.batch.Len()
		}
		score := scoring && p >= len(q.scores) && p < len(q.g.req.Prompt)-1
		pos, y, x, _ := q.g.req.position(p)
		switch t := q.tokens[p]; {
		case t < 0 && s.cap.MRoPE:
			s.batch.AddEmbdAt(t, q.g.req.mediaRow(p), pos, y, x, engine.SeqID(q.kv.ID), sample || score)
		case t < 0:
			// An image's row (Request.Media), in the prompt only.
			s.batch.AddEmbd(t, q.g.req.mediaRow(p), pos, engine.SeqID(q.kv.ID), sample || score)
		default:
			s.batch.Add(t, pos, engine.SeqID(q.kv.ID), sample || score)
		}
		s.rows = append(s.rows, nil)
		if sample {
			s.rows[len(s.rows)-1] = q
		}
	}
}

// grow accounts toks for q, preempting other sequences when KV runs out. It returns
// false if q itself was preempted (or could not grow).
func (s *Scheduler) grow(q *seq, toks []engine.Token) bool {
	for {
		ops, err := s.pool.Grow(q.kv, toInt32(toks))
		if err == nil {
			if aerr := s.apply(ops); aerr != nil {
				s.failAll(fmt.Errorf("apply KV ops: %w", aerr))
				return false
			}
			return true
		}
		if !errors.Is(err, kvcache.ErrNoSpace) {
			s.failAll(fmt.Errorf("kv grow: %w", err))
			return false
		}
		victim := s.victim()
		if victim == nil {
			return false
		}
		s.preempt(victim)
		if victim == q {
			return false
		}
	}
}

// victim is the lowest-priority, most recently arrived running sequence.
func (s *Scheduler) victim() *seq {
	var v *seq
	for _, q := range s.running {
		if v == nil || q.g.req.Priority > v.g.req.Priority || (q.g.req.Priority == v.g.req.Priority && q.arrival > v.arrival) {
			v = q
		}
	}
	return v
}

// preempt drops q's KV (its blocks stay cached) and puts it back in the queue; it
// resumes by recomputing its prompt and generated tokens.
func (s *Scheduler) preempt(q *seq) {
	s.removeFromBatch(q)
	s.requeue(q)
	s.stats.Preemptions++
	s.log.Debug("preempted", "seq", q.arrival, "tokens", len(q.tokens))
}

// removeFromBatch takes q's rows out of the batch being built.
func (s *Scheduler) removeFromBatch(q *seq) {
	if q.kv == nil || !s.building {
		return // after the decode, row numbers must stay those of the decoded batch
	}
	id := engine.SeqID(q.kv.ID)
	var nr []*seq
	for i := range s.batch.Len() {
		if s.batch.Seq[i] == id {
			continue
		}
		if r := s.rows[i]; r != nil {
			r.sampleRow = len(nr)
		}
		nr = append(nr, s.rows[i])
	}
	s.batch.Keep(func(i int) bool { return s.batch.Seq[i] != id })
	s.rows = nr
	q.sampleRow = -1
	if q.decoding {
		s.decodeRows--
		q.decoding = false
	}
}

// release gives back q's KV: for good, or for a resume, when its blocks are kept
// past the cache budget until it takes them back (kvcache.Allocator.Suspend).
func (s *Scheduler) release(q *seq, resume bool) {
	if q.kv == nil {
		if q.suspended && !resume {
			// Ended while waiting to resume: its kept blocks are cache now.
			if err := s.apply(s.pool.Abandon(s.model(q), toInt32(q.tokens))); err != nil {
				s.log.Error("abandon suspended KV", "err", err)
			}
			q.suspended = false
		}
		return
	}
	free := s.pool.Release
	if resume {
		free = s.pool.Suspend
	}
	if err := s.apply(free(q.kv)); err != nil {
		s.log.Error("release KV", "resume", resume, "err", err)
	}
	q.kv, q.suspended = nil, resume
}

// requeue takes running q out of the batch's accounting and puts it back in the
// queue, to resume by recomputing what is no longer cached.
func (s *Scheduler) requeue(q *seq) {
	s.release(q, true)
	q.committed = 0
	s.removeFromRunning(q)
	s.enqueue(q)
	s.waiting.Add(1)
}

// place notes that KV sequence id holds r's cells from now on (before the
// ops that give it them are applied), when r's images are placed by M-RoPE.
func (s *Scheduler) place(id kvcache.SeqID, r *Request) {
	if !s.cap.MRoPE {
		return
	}
	if len(r.Media) == 0 {
		delete(s.placed, id)
		return
	}
	if s.placed == nil {
		s.placed = map[kvcache.SeqID][]engine.Media{}
	}
	layout := make([]engine.Media, len(r.Media))
	for i, m := range r.Media {
		m.Embd = nil
		layout[i] = m
	}
	s.placed[id] = layout
}

// positions are KV range [p0, p1) of sequence id (-1: its end) as the
// engine's positions; ok is false when an end falls within an M-RoPE image,
// whose cells can only be taken together (kvcache.Config.UncutMedia keeps
// that from happening).
func (s *Scheduler) positions(id kvcache.SeqID, p0, p1 int32) (q0, q1 engine.Pos, ok bool) {
	media := s.placed[id]
	at := func(p int32) (engine.Pos, bool) {
		if media == nil || p < 0 {
			return engine.Pos(p), true
		}
		pos, _, _, within := position(media, int(p))
		return pos, !within
	}
	q0, ok0 := at(p0)
	q1, ok1 := at(p1)
	return q0, q1, ok0 && ok1
}

func (s *Scheduler) apply(ops []kvcache.Op) error {
	for _, o := range ops {
		var err error
		switch o.Kind {
		case kvcache.OpRemove:
			p0, p1, ok := s.positions(o.Seq, o.P0, o.P1)
			if !ok {
				return fmt.Errorf("%v: the range cuts an image placed by M-RoPE", o)
			}
			err = s.eng.SeqRemove(engine.SeqID(o.Seq), p0, p1)
		case kvcache.OpCopy:
			p0, p1, ok := s.positions(o.Src, o.P0, o.P1)
			if !ok {
				return fmt.Errorf("%v: the range cuts an image placed by M-RoPE", o)
			}
			err = s.eng.SeqCopy(engine.SeqID(o.Src), engine.SeqID(o.Seq), p0, p1)
		}
		if err != nil {
			return fmt.Errorf("%v: %w", o, err)
		}
	}
	return nil
}

func (s *Scheduler) decode(ctx context.Context) {
	start := time.Now()
	err := s.eng.Decode(ctx, &s.batch)
	if err != nil {
		if errors.Is(err, engine.ErrNoKVSpace) && s.draftTokens > 0 {
			// The proposals' rows may be what did not fit: the step again
			// without any, before anyone is failed or the batch made smaller.
			s.undoBatch()
			s.specPause = capRecoverSteps
			s.log.Debug("the engine found no KV cells for a batch with proposals; pausing them", "proposed", s.draftTokens)
			return
		}
		if errors.Is(err, engine.ErrNoKVSpace) {
			// The engine could not place the batch although the pool had room
			// (fragmentation). Requeue the batch and run fewer sequences until
			// steps succeed again; a sequence that cannot be placed even alone
			// fails.
			if len(s.running) <= 1 {
				for _, q := range slices.Clone(s.running) {
					s.fail(q.g, fmt.Errorf("decode: %w: the engine cannot place this sequence even alone", err))
				}
				return
			}
			v := s.victim()
			undone := s.undoBatch()
			half := max(1, len(undone)/2)
			if s.runCap > 0 {
				half = min(half, s.runCap)
			}
			s.runCap, s.capSteps = half, 0
			s.log.Warn("the engine found no KV cells for the batch; running fewer sequences", "in_batch", len(undone), "cap", s.runCap)
			if v != nil && v.kv != nil { // not in the batch: it still holds cells
				s.preempt(v)
			}
			return
		}
		if ctx.Err() != nil {
			// Stopping (a drain that ran out of time): Run's shutdown ends every
			// request with ErrClosed, which clients read as the node shutting down.
			s.undoBatch()
			return
		}
		// A failed pass fails the requests in it; the node keeps serving.
		s.log.Error("decode failed", "tokens", s.batch.Len(), "err", err)
		affected := map[*group]bool{}
		for _, q := range s.undoBatch() {
			affected[q.g] = true
		}
		for g := range affected {
			s.fail(g, fmt.Errorf("decode: %w", err))
		}
		return
	}
	elapsed := time.Since(start)
	if s.runCap > 0 {
		// After a few steps, not at once: a resumed sequence spends a step
		// recomputing before it decodes, and raising the cap at once would undo
		// that step again and again. By a quarter, so that a large batch comes
		// back in tens of steps.
		if s.capSteps++; s.capSteps >= capRecoverSteps {
			s.capSteps = 0
			if s.runCap += max(1, s.runCap/4); s.runCap >= s.cfg.MaxRunning {
				s.runCap = 0
			}
		}
	}
	decodeTokens := s.decodeRows
	prefillTokens := s.batch.Len() - decodeTokens - s.draftTokens
	s.stats.Steps++
	s.stats.countStep(s.batch.Len())
	s.stats.ComputedTokens += uint64(prefillTokens)
	if prefillTokens >= minRateTokens && prefillTokens >= prefillDominates*decodeTokens {
		s.stats.PrefillTokensPS = s.prefillPS.add(prefillTokens, elapsed)
	}

	// The batch's cells now exist: make its full blocks shareable. Those of a
	// sequence with proposals wait until they are checked (takeDrafts).
	for _, q := range slices.Clone(s.running) { // a failed commit ends q's request
		switch {
		case q.done || !s.inBatch(q):
		case q.draft == nil:
			if s.commit(q) {
				q.committed = q.computed()
			}
		default:
			q.draftOK = q.draftAt // computed for certain: what an end before the check keeps
		}
	}
	s.scorePrompts()
	// Fork pending choices from first choices whose prompt just completed, so they
	// sample from the same logits row.
	for _, q := range slices.Clone(s.rows) {
		if q == nil || q.index != 0 || q.gen != 0 || len(q.g.seqs) == 1 {
			continue
		}
		for _, c := range q.g.seqs[1:] {
			if c.forkFrom == q && c.kv == nil && !c.done {
				s.fork(q, c)
			}
		}
	}
	// Sequences with a row sample (forked choices use their first choice's row);
	// embedding requests read their pooled vector instead.
	var sampling []*seq
	for _, q := range slices.Clone(s.running) {
		switch {
		case !q.running || q.sampleRow < 0:
		case q.g.req.Embed:
			s.emitEmbedding(q)
		default:
			sampling = append(sampling, q)
		}
	}
	s.sampleRows(sampling)
	// Tokens generated: a decode row's, and the proposals taken after it.
	s.stats.DecodeTokensPS = s.decodePS.add(decodeTokens+s.stepAccepted, elapsed)
	// This step's finishes (and cancellations since the last step) against its time.
	s.stats.FinishPS = s.finishPS.add(s.ended, elapsed)
	s.endedAny = s.endedAny || s.ended > 0
	s.ended = 0
}

// inBatch reports whether running sequence q has rows in this step's batch.
func (s *Scheduler) inBatch(q *seq) bool {
	return q.kv != nil && slices.Contains(s.batch.Seq, engine.SeqID(q.kv.ID))
}

// undoBatch rolls the pool back for tokens accounted this step but not decoded, by
// releasing the affected sequences' KV and requeueing them, and returns them.
func (s *Scheduler) undoBatch() []*seq {
	var undone []*seq
	for _, q := range s.running {
		if s.inBatch(q) {
			undone = append(undone, q)
		}
	}
	for _, q := range undone {
		s.requeue(q)
	}
	return undone
}

// fork starts choice c as a copy of q, whose prompt has just been computed.
func (s *Scheduler) fork(q, c *seq) {
	var kv *kvcache.Seq
	var ops []kvcache.Op
	err := errRunningFull
	if len(s.running) < s.maxRunning() {
		if kv, ops, err = s.pool.Fork(q.kv); err == nil {
			s.place(kv.ID, q.g.req)
			if err = s.apply(ops); err != nil {
				if rerr := s.apply(s.pool.Release(kv)); rerr != nil {
					s.log.Error("release a failed fork", "err", rerr)
				}
			}
		}
	}
	if err != nil {
		// No room to fork now (no slot, no blocks, or the copy failed): the choice
		// computes its own prompt later, mostly from the cache (it is already
		// counted as waiting).
		c.forkFrom = nil
		s.enqueue(c)
		return
	}
	c.kv = kv
	c.running = true
	c.sampleRow = q.sampleRow
	s.running = append(s.running, c)
	s.waiting.Add(-1)
}

// capRecoverSteps is how many steps a reduced runCap holds before it grows.
const capRecoverSteps = 16

// maxRunning is how many sequences may run now: MaxRunning, or less for a while
// after the engine could not place a batch (runCap).
func (s *Scheduler) maxRunning() int {
	if s.runCap > 0 {
		return min(s.runCap, s.cfg.MaxRunning)
	}
	return s.cfg.MaxRunning
}

// errRunningFull: every running slot (Config.MaxRunning) is taken.
var errRunningFull = errors.New("scheduler: every running slot is taken")

// rate is an exponentially weighted moving average of events per second over the
// time the scheduler steps, weighted by each step's duration (half-life
// rateHalfLife) and corrected for its start at zero: the first step's rate stands
// alone, and later steps blend in. (Uncorrected, a node's first seconds would report
// a small fraction of its real speed, and routers would price its work that wrong.)
type rate struct {
	v      float64 // the average, biased toward zero
	weight float64 // 1 - Π(1-w): how much of v the samples make up
}

// add records n events in a step of duration d and returns the corrected rate.
func (r *rate) add(n int, d time.Duration) float64 {
	if d > 0 {
		w := 1 - math.Exp2(-d.Seconds()/rateHalfLife.Seconds())
		r.v += w * (float64(n)/d.Seconds() - r.v)
		r.weight += w * (1 - r.weight)
	}
	if r.weight == 0 {
		return 0
	}
	return r.v / r.weight
}

// emitEmbedding publishes the pooled embedding of q's prompt and ends it.
func (s *Scheduler) emitEmbedding(q *seq) {
	vec, err := s.eng.Embeddings(engine.SeqID(q.kv.ID))
	if err != nil {
		s.fail(q.g, fmt.Errorf("embeddings: %w", err))
		return
	}
	s.stats.PromptTokens += uint64(q.g.usage.PromptTokens)
	q.g.stream.push(Event{Kind: EventEmbedding, Index: q.index, Vector: vec})
	s.finish(q, Event{Finish: FinishStop})
}

// sampled is one sequence's draw of a step.
type sampled struct {
	view []float32 // the row's logits, for a parallel draw
	out  engine.Sampled
	err  error
}

// sampleRows draws the next token of each of qs from its batch row, then publishes
// them in order. With an engine.LogitsViewer and more than one worker, the draws run
// in parallel (each sequence has its own sampler; rows are read-only views), except
// those with a grammar, which calls into the engine; publishing stays on this
// goroutine.
func (s *Scheduler) sampleRows(qs []*seq) {
	res := make([]sampled, len(qs))
	viewer, _ := s.eng.(engine.LogitsViewer)
	workers := s.workers()
	fanOut := viewer != nil && workers > 1 && len(qs) > 1
	var parallel []int
	for i, q := range qs {
		if q.sampler == nil {
			if err := s.newSampler(q); err != nil {
				res[i].err = err
				continue
			}
		}
		if fanOut && q.g.req.Grammar == "" {
			if res[i].view, res[i].err = viewer.LogitsView(q.sampleRow); res[i].err == nil {
				parallel = append(parallel, i)
			}
			continue
		}
		if err := s.eng.Logits(q.sampleRow, func(l []float32) { res[i].out, res[i].err = s.sampleSafely(q.sampler, l) }); err != nil {
			res[i].err = err
		}
	}
	fan(workers, len(parallel), func(k int) {
		r := &res[parallel[k]]
		r.out, r.err = s.sampleSafely(qs[parallel[k]].sampler, r.view)
	})
	for i, q := range qs {
		if q.running && !q.done { // an earlier failure of its group ended it
			s.emitSampled(q, res[i].out, res[i].err)
			if q.draft != nil {
				s.takeDrafts(q, res[i].out.Token)
			}
		}
	}
}

// sampleSafely draws from logits with sm, and acceptSafely records a token
// in it. A panic in the sampler (a bug that some request's parameters reach)
// fails that request, not the node: the scheduler's goroutine and the
// sampling workers have no other recover. The stack goes to the log. Safe to
// call from the sampling workers.
func (s *Scheduler) sampleSafely(sm engine.Sampler, logits []float32) (out engine.Sampled, err error) {
	defer s.recoverSampler(&err)
	return sm.Sample(logits)
}

func (s *Scheduler) acceptSafely(sm engine.Sampler, t engine.Token, generated bool) (err error) {
	defer s.recoverSampler(&err)
	sm.Accept(t, generated)
	return nil
}

func (s *Scheduler) recoverSampler(err *error) {
	if r := recover(); r != nil {
		s.log.Error("sampler panicked", "panic", r, "stack", string(debug.Stack()))
		*err = fmt.Errorf("sampler panicked: %v", r)
	}
}

// workers is how many goroutines read a step's logits rows.
func (s *Scheduler) workers() int {
	if s.cfg.SampleWorkers > 0 {
		return s.cfg.SampleWorkers
	}
	return runtime.GOMAXPROCS(0)
}

// fan calls f(0), ..., f(n-1) on up to workers goroutines and waits for them.
func fan(workers, n int, f func(k int)) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(workers, n) {
		wg.Go(func() {
			for k := int(next.Add(1) - 1); k < n; k = int(next.Add(1) - 1) {
				f(k)
			}
		})
	}
	wg.Wait()
}

// scorePrompts scores the prompt tokens that follow this step's rows of the
// sequences scoring their prompts (Request.PromptLogprobs), and sends the scores
// of a prompt computed to its end. Each score reads a whole row of logits
// (three passes over the vocabulary), so with an engine.LogitsViewer the rows are
// read in parallel.
func (s *Scheduler) scorePrompts() {
	type job struct {
		q    *seq
		row  int
		next engine.Token // the prompt token the row's logits predict
		view []float32
		out  engine.TokenScore
		err  error
	}
	var jobs []job
	for _, q := range s.running {
		if !q.running || !q.scoring() || !s.inBatch(q) {
			continue
		}
		id, prompt, want := engine.SeqID(q.kv.ID), q.g.req.Prompt, len(q.scores)
		for i := range s.batch.Len() {
			if p := int(s.batch.Pos[i]); s.batch.Seq[i] == id && s.batch.Output[i] && p == want && p < len(prompt)-1 {
				jobs = append(jobs, job{q: q, row: i, next: prompt[p+1]})
				want++
			}
		}
	}
	viewer, _ := s.eng.(engine.LogitsViewer)
	if viewer != nil && s.workers() > 1 && len(jobs) > 1 {
		for i := range jobs {
			jobs[i].view, jobs[i].err = viewer.LogitsView(jobs[i].row)
		}
		fan(s.workers(), len(jobs), func(k int) {
			if j := &jobs[k]; j.err == nil {
				j.out, j.err = sample.Score(j.view, j.next, j.q.g.req.PromptTopLogprobs)
			}
		})
	} else {
		for i := range jobs {
			j := &jobs[i]
			if err := s.eng.Logits(j.row, func(l []float32) { j.out, j.err = sample.Score(l, j.next, j.q.g.req.PromptTopLogprobs) }); err != nil {
				j.err = err
			}
		}
	}
	for _, j := range jobs {
		switch {
		case j.q.done || j.q.g.failed:
		case j.err != nil:
			s.fail(j.q.g, fmt.Errorf("score prompt: %w", j.err))
		default:
			j.q.scores = append(j.q.scores, j.out)
		}
	}
	for _, q := range slices.Clone(s.running) { // fail takes sequences out
		if q.running && q.scoring() && s.inBatch(q) && q.computed() >= len(q.g.req.Prompt) {
			if len(q.scores) != len(q.g.req.Prompt)-1 {
				s.fail(q.g, fmt.Errorf("score prompt: %d of %d tokens scored", len(q.scores), len(q.g.req.Prompt)-1))
				continue
			}
			q.g.stream.push(Event{Kind: EventPromptLogprobs, Prompt: q.scores})
			q.scores, q.scored = nil, true
		}
	}
}

// emitSampled publishes q's drawn token (or fails its request on err).
func (s *Scheduler) emitSampled(q *seq, out engine.Sampled, serr error) {
	g := q.g
	if serr != nil {
		switch {
		case errors.Is(serr, sample.ErrNoneAllowed):
			// The request's own constraint: a schema no value meets, a bias
			// that bans every token.
			serr = fmt.Errorf("%w: the request's output constraint (grammar, schema, logit_bias, allowed_token_ids, bad_words) allows no next token, or is too costly to follow", ErrInvalid)
		case !errors.Is(serr, ErrInvalid):
			serr = fmt.Errorf("sample: %w", serr)
		}
		s.fail(g, serr)
		return
	}
	tok := out.Token
	if err := s.acceptSafely(q.sampler, tok, true); err != nil {
		s.fail(g, fmt.Errorf("sample: %w", err))
		return
	}
	q.gen++
	if q.gen == 1 && q.index == 0 {
		s.stats.PromptTokens += uint64(g.usage.PromptTokens) // once per request, as vLLM
	}
	s.stats.GeneratedTokens++
	g.usage.CompletionTokens++

	if !g.req.IgnoreEOS && s.vocab.IsEOG(tok) {
		// Counted in completion_tokens, it has its logprobs as every token
		// drawn has (vLLM's and llama-server's answers list it too), and no
		// text: text held back as the possible start of a stop string is
		// output after all.
		g.stream.push(Event{Kind: EventToken, Index: q.index, Token: tok, Text: q.held + q.detok.Flush(), Logprob: out.Logprob, Top: out.Top, Step: s.stats.Steps, EndOfGeneration: true})
		q.held = ""
		s.finish(q, Event{Finish: FinishStop})
		return
	}
	q.tokens = append(q.tokens, tok)
	piece, err := s.vocab.Piece(tok, g.req.SpecialTokens)
	if err != nil {
		s.fail(g, fmt.Errorf("detokenize: %w", err))
		return
	}
	stopToken := slices.Contains(g.req.StopTokens, tok)
	if stopToken && !g.req.IncludeStop {
		piece = nil // its text is left out, as vLLM leaves it out
	}
	text := q.held + q.detok.Add(piece)
	q.held = ""
	var stop string
	text, q.held, stop = MatchStopAfter(text, g.req.Stop, g.req.IncludeStop, q.gen, g.req.MinTokens)
	ev := Event{Kind: EventToken, Index: q.index, Token: tok, Text: text, Logprob: out.Logprob, Top: out.Top, Step: s.stats.Steps}
	g.stream.push(ev)
	switch {
	case stop != "":
		q.held = ""
		s.finish(q, Event{Finish: FinishStop, StopString: stop})
	case stopToken:
		s.finish(q, Event{Finish: FinishStop, Text: q.held + q.detok.Flush(), Token: tok, ByStopToken: true})
	case q.gen >= q.maxNew || len(q.tokens) >= s.MaxContext():
		s.finish(q, Event{Finish: FinishLength, Text: q.held + q.detok.Flush()})
	}
}

func (s *Scheduler) newSampler(q *seq) error {
	g := q.g
	p := g.req.Sampling
	p.Seed += uint64(q.index) // choices of one request draw differently but reproducibly
	var gr engine.Grammar
	if g.req.Grammar != "" {
		var err error
		if gr, err = s.eng.NewGrammar(g.req.Grammar, g.req.GrammarTriggers); err != nil {
			return fmt.Errorf("%w: grammar: %w", ErrInvalid, err)
		}
	}
	if g.req.MinTokens > 0 {
		p.MinTokens = g.req.MinTokens
		if !g.req.IgnoreEOS {
			p.EndTokens = s.endTokens()
		}
		p.EndTokens = append(slices.Clip(p.EndTokens), g.req.StopTokens...)
	}
	sm, err := sample.New(p, gr)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	for _, t := range g.req.Prompt {
		if err := s.acceptSafely(sm, t, false); err != nil {
			sm.Close()
			return err
		}
	}
	q.sampler = sm
	return nil
}

// endTokens are the vocabulary's end-of-generation tokens, listed once.
func (s *Scheduler) endTokens() []engine.Token {
	if s.eog == nil {
		s.eog = []engine.Token{}
		for t := range engine.Token(s.vocab.Size()) {
			if s.vocab.IsEOG(t) {
				s.eog = append(s.eog, t)
			}
		}
	}
	return s.eog
}

// MatchStop finds the earliest stop string in text and returns it and the text
// before it (through it when include). Without one, it splits text into what
// can be emitted and the longest suffix that could still begin a stop string
// (the api applies it to tool-protocol answers, whose text is decoded from
// JSON).
func MatchStop(text string, stops []string, include bool) (emit, held, stop string) {
	if len(stops) == 0 {
		return text, "", ""
	}
	first, end := -1, 0
	for _, st := range stops {
		if i := strings.Index(text, st); i >= 0 && (first < 0 || i < first || i == first && i+len(st) > end) {
			first, end = i, i+len(st)
		}
	}
	if first >= 0 {
		if include {
			return text[:end], "", text[first:end]
		}
		return text[:first], "", text[first:end]
	}
	emit, held = holdBack(text, stops)
	return emit, held, ""
}

// MatchStopAfter is MatchStop for text that ends with a choice's gen-th
// token: within its first minTokens tokens no stop string ends it, but one
// that ends after them may begin there (vLLM matches the stop strings that end
// in the text of a token after them, wherever they begin), so the end that may
// begin one is held back all the same.
func MatchStopAfter(text string, stops []string, include bool, gen, minTokens int) (emit, held, stop string) {
	if minTokens > 0 && gen <= minTokens {
		emit, held = holdBack(text, stops)
		return emit, held, ""
	}
	return MatchStop(text, stops, include)
}

// holdBack splits text into what can be emitted and the longest suffix that
// could still begin a stop string; a whole stop string in text is emitted.
func holdBack(text string, stops []string) (emit, held string) {
	keep := 0
	for _, st := range stops {
		for k := min(len(st)-1, len(text)); k > keep; k-- {
			if strings.HasSuffix(text, st[:k]) {
				keep = k
				break
			}
		}
	}
	return text[:len(text)-keep], text[len(text)-keep:]
}

// finish ends choice q with ev, an EventFinish without its kind and index:
// the reason, the text held back until now, what stopped it.
func (s *Scheduler) finish(q *seq, ev Event) {
	if q.done {
		return
	}
	q.done = true
	if q.running {
		s.ended++
	}
	s.removeFromRunning(q)
	s.keepVerified(q)
	s.release(q, false)
	if q.sampler != nil {
		q.sampler.Close()
	}
	g := q.g
	ev.Kind, ev.Index = EventFinish, q.index
	g.stream.push(ev)
	g.open--
	if g.open == 0 {
		g.stream.push(Event{Kind: EventDone, Usage: g.usage})
	}
}

// keepVerified commits, for q ending amid its proposals, the positions they
// verified (computed, as any ended sequence's are, and cached as theirs), and
// trims the rest.
func (s *Scheduler) keepVerified(q *seq) {
	if q.kv != nil && q.draftOK > 0 {
		if ops, err := s.pool.Trim(q.kv, q.draftOK); err == nil && s.apply(ops) == nil {
			_ = s.apply(s.pool.Commit(q.kv)) // q ends: a failure costs only the cache
		}
	}
	q.draftOK = 0
}

func (s *Scheduler) removeFromRunning(q *seq) {
	q.running = false
	s.running = slices.DeleteFunc(s.running, func(x *seq) bool { return x == q })
}

// fail ends every choice of g with err.
func (s *Scheduler) fail(g *group, err error) {
	if g.failed {
		return
	}
	g.failed = true
	for _, q := range g.seqs {
		if q.done {
			continue
		}
		q.done = true
		if i := slices.Index(s.queue, q); i >= 0 {
			s.queue = slices.Delete(s.queue, i, i+1)
			s.waiting.Add(-1)
		} else if q.kv == nil && q.forkFrom != nil {
			s.waiting.Add(-1) // a choice waiting for its fork
		}
		s.removeFromBatch(q)
		s.removeFromRunning(q)
		s.keepVerified(q)
		s.release(q, false)
		if q.sampler != nil {
			q.sampler.Close()
		}
	}
	g.stream.push(Event{Kind: EventError, Err: err})
}

func (s *Scheduler) failAll(err error) {
	for _, q := range slices.Concat(s.running, s.queue) {
		s.fail(q.g, err)
	}
}

// dropCancelled ends requests whose context or deadline has passed, and choices
// their reader stopped (Stream.Stop).
func (s *Scheduler) dropCancelled() {
	now := time.Now()
	check := func(q *seq) {
		g := q.g
		if g.failed || q.done {
			return
		}
		if err := g.ctx.Err(); err != nil {
			s.cancel(g, err)
		} else if !g.req.Deadline.IsZero() && now.After(g.req.Deadline) {
			s.cancel(g, context.DeadlineExceeded)
		} else if reason, ok := g.stream.stopped(q.index); ok {
			s.end(q, reason)
		}
	}
	for _, q := range slices.Concat(s.running, s.queue) {
		check(q)
	}
}

// cancel ends g's choices with FinishCancelled, freeing their KV now.
func (s *Scheduler) cancel(g *group, cause error) {
	for _, q := range g.seqs {
		s.end(q, FinishCancelled)
	}
	s.log.Debug("request cancelled", "cause", cause)
}

// end ends choice q with reason wherever it is (running, queued, or waiting for
// its fork), freeing its KV now.
func (s *Scheduler) end(q *seq, reason FinishReason) {
	if q.done {
		return
	}
	if i := slices.Index(s.queue, q); i >= 0 {
		s.queue = slices.Delete(s.queue, i, i+1)
		s.waiting.Add(-1)
	} else if q.kv == nil {
		s.waiting.Add(-1) // waiting for its fork
	}
	ev := Event{Finish: reason}
	if reason == FinishLength {
		ev.Text = q.held + q.detok.Flush() // cut at a limit: what was held back is output
	}
	s.finish(q, ev)
}

func (s *Scheduler) publish() {
	s.pool.Publish()
	st := s.pool.Stats()
	l := s.stats
	l.Waiting, l.MaxWaiting, l.MaxBatchTokens, l.MaxRunning = int(s.waiting.Load()), s.cfg.MaxWaiting, s.cfg.MaxBatchTokens, s.cfg.MaxRunning
	l.Running = len(s.running)
	l.SpecTokens = s.cfg.Spec.Tokens
	l.KVBlocksUsed, l.KVBlocksCached, l.KVBlocksTotal, l.KVBlockTokens = st.Used, st.Cached, st.Blocks, st.BlockTokens
	l.KVCacheBudget = st.CacheBudget
	l.PrefixQueries, l.PrefixHits, l.CacheGeneration = st.Queries, st.HitTokens, st.Generation
	pending := 0
	for _, q := range s.queue {
		pending += q.uncached
	}
	l.PendingTokens = pending
	for _, q := range s.running {
		l.PendingTokens += max(len(q.tokens)-1-q.computed(), 0)
	}
	if !s.endedAny && len(s.running) > 0 && l.DecodeTokensPS > 0 {
		// Nothing has finished yet (a node that just started, under a burst): until
		// something does, predict the finish rate from the tokens the running
		// sequences may still generate.
		left, maxContext := 0, s.MaxContext()
		for _, q := range s.running {
			left += max(q.reserve(maxContext), 1)
		}
		l.FinishPS = l.DecodeTokensPS * float64(len(s.running)) / float64(left)
	}
	l.QueueWait = 0
	if l.PrefillTokensPS > 0 {
		l.QueueWait = waitFor(float64(pending), l.PrefillTokensPS)
	}
	// (The slot wait counts toward saturation only once measured: a prediction from
	// generous max_tokens must not turn a starting node's first burst away. Once
	// measured, a finish rate that has decayed towards zero, every slot held by long
	// generations, is the longest wait, not none, unless the running sequences' own
	// limits say when they end: finishes come in bursts (a batch started together
	// ends together), and between bursts the measured rate decays far below the
	// rate at which slots free.)
	if need := l.Waiting + 1 - (s.maxRunning() - l.Running); need > 0 && s.endedAny {
		wait := waitFor(float64(need), l.FinishPS)
		if len(s.running) > 0 && l.DecodeTokensPS > 0 {
			// What each running and queued sequence may still generate, at most.
			maxContext := s.MaxContext()
			most := func(q *seq) int { return max(q.room(maxContext), 1) }
			left := make([]int, 0, len(s.running))
			for _, q := range s.running {
				left = append(left, most(q))
			}
			queued := make([]int, 0, len(s.queue))
			for _, q := range s.queue {
				queued = append(queued, most(q))
			}
			wait = min(wait, slotsFreedIn(left, queued, need, l.DecodeTokensPS))
		}
		l.QueueWait = max(l.QueueWait, wait)
	}
	if n := len(s.cfg.Adapters); n > 0 {
		l.AdapterRunning, l.AdapterWaiting = make([]int, n), make([]int, n)
		for _, q := range s.running {
			if a := q.g.req.Adapter; a > 0 {
				l.AdapterRunning[a-1]++
			}
		}
		for _, q := range s.queue {
			if a := q.g.req.Adapter; a > 0 {
				l.AdapterWaiting[a-1]++
			}
		}
	}
	l.UpdatedAt = time.Now()
	s.load.Store(&l)
}

// slotsFreedIn bounds the time until need sequences have ended, when the
// running ones may still generate left tokens each, the queued ones (in
// order) queued tokens each once they run, and the batch generates decodePS
// tokens a second shared among len(left) slots: each slot, freed, takes the
// next queued sequence.
func slotsFreedIn(left, queued []int, need int, decodePS float64) time.Duration {
	n := len(left)
	if n == 0 || need < 1 || decodePS <= 0 {
		return maxQueueWait
	}
	// ends holds when each slot frees, in tokens of one sequence's time.
	ends := &tokenHeap{}
	for _, x := range left {
		heap.Push(ends, float64(x))
	}
	var at float64
	for ended := 0; ended < need; ended++ {
		at = heap.Pop(ends).(float64)
		if ended < len(queued) {
			heap.Push(ends, at+float64(queued[ended]))
		} else if ends.Len() == 0 {
			break
		}
	}
	return waitFor(at, decodePS/float64(n))
}

// tokenHeap is a min-heap of times, for slotsFreedIn.
type tokenHeap []float64

func (h tokenHeap) Len() int           { return len(h) }
func (h tokenHeap) Less(i, j int) bool { return h[i] < h[j] }
func (h tokenHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *tokenHeap) Push(x any)        { *h = append(*h, x.(float64)) }
func (h *tokenHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// maxQueueWait bounds the estimate: beyond it a wait is as good as forever, and
// a Duration cannot hold the quotient of a rate decayed towards zero.
const maxQueueWait = 24 * time.Hour

// waitFor is how long n events take at perSecond, at most maxQueueWait.
func waitFor(n, perSecond float64) time.Duration {
	if secs := n / perSecond; perSecond > 0 && secs < maxQueueWait.Seconds() {
		return time.Duration(secs * float64(time.Second))
	}
	return maxQueueWait
}

func toInt32(t []engine.Token) []int32 {
	out := make([]int32, len(t))
	for i, x := range t {
		out[i] = int32(x)
	}
	return out
}
