package kvcache

// Allocator is what the scheduler needs from a KV accounting scheme. Pool accounts
// one unified cell pool (blocks shared by partial copies); SplitPool accounts one
// stream per sequence (a cached prefix reused by copying a whole stream and trimming).
//
// The methods that look a prompt up take the id of the model whose KV it is:
// "" for the pool's own (Config.Model), a LoRA adapter's otherwise, whose
// blocks hash apart (a prefix computed under one is not another's).
//
// Concurrency: owned by one goroutine, except Stats and Summary (any goroutine).
type Allocator interface {
	BlockTokens() int
	TotalBlocks() int
	// Fits reports whether a sequence with this prompt and up to maxNew generated
	// tokens can start now (counting its cached prefix as resident).
	Fits(model string, prompt []int32, maxNew int) bool
	// CachedPrefix is how many leading tokens of prompt Start would reuse.
	CachedPrefix(model string, prompt []int32) int
	Start(model string, prompt []int32) (*Seq, []Op, error)
	// Resume starts a sequence that Suspend ended, from its prompt and generated
	// tokens: what is still cached of them is its own, not a cache hit.
	Resume(model string, tokens []int32) (*Seq, []Op, error)
	Grow(s *Seq, toks []int32) ([]Op, error)
	// Spare reports whether s can grow by n positions from free cells alone,
	// evicting no cached block (for speculative rows that may be thrown away).
	Spare(s *Seq, n int) bool
	// Trim takes back s's positions from n on, accounted by Grow and not
	// committed since (draft tokens the model turned down): their blocks are
	// freed, and the ops remove their cells.
	Trim(s *Seq, n int) ([]Op, error)
	// Commit makes s's computed full blocks shareable; the ops (which may swap
	// a block s computed again for the cached one equal to it) are applied
	// before s's next decode.
	Commit(s *Seq) []Op
	Release(s *Seq) []Op
	// Suspend ends a preempted sequence that will Resume.
	Suspend(s *Seq) []Op
	// Abandon is for a suspended sequence that will not Resume after all
	// (cancelled, or ended while it waited), from its prompt and generated tokens:
	// what Suspend kept of them is cached as Release would have left it.
	Abandon(model string, tokens []int32) []Op
	Fork(s *Seq) (*Seq, []Op, error)
	// DropCached evicts every cached block no running sequence uses (vLLM's
	// reset_prefix_cache), returning how many, and leaves the cache's
	// adaptive budget as it was.
	DropCached() (int, []Op)
	Publish()
	Stats() Stats
	Summary() *Summary
}

var (
	_ Allocator = (*Pool)(nil)
	_ Allocator = (*SplitPool)(nil)
)
