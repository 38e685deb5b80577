// Package engine defines what shoal needs from an inference engine: a loaded model with
// one context whose KV cells are shared by many sequences (Engine), its tokenizer
// (Vocab), and the plain value types that cross the boundary. It has no cgo and imports
// nothing of shoal's; engine/llama implements it over llama.cpp and engine/sim with a
// time model, so the scheduler can be tested and benchmarked without either.
package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// Token is a vocabulary id.
type Token int32

// SeqID names a sequence in the engine's KV memory. Valid ids are 0..Capacity().MaxSeqs-1.
type SeqID int32

// Pos is a token position within a sequence.
type Pos int32

// Errors callers branch on. Implementations wrap them with the failing operation.
var (
	// ErrNoKVSpace means the batch did not fit into the free KV cells; nothing was decoded.
	// The caller frees cells (evict, preempt) and retries.
	ErrNoKVSpace = errors.New("no free KV cells for the batch")
	// ErrAborted means Abort stopped the decode; KV state of the batch is undefined for
	// the sequences in it, which should be removed.
	ErrAborted = errors.New("decode aborted")
	// ErrInvalidInput marks requests the engine rejects before touching any state: an
	// out-of-range token or sequence id, a batch larger than the context, and the like.
	ErrInvalidInput = errors.New("invalid input")
	// ErrClosed is returned by every method after Close.
	ErrClosed = errors.New("engine closed")
	// ErrUnsupported marks an operation the model cannot do (embeddings from a model
	// without pooling, prefix sharing on recurrent memory, ...).
	ErrUnsupported = errors.New("unsupported by this model")
)

// ModelInfo is what the model file says about itself.
type ModelInfo struct {
	Name            string // general.name, else the file's base name
	Architecture    string // general.architecture, e.g. "llama"
	Description     string // llama.cpp's one-line description (type, size, quantisation)
	Params          uint64
	SizeBytes       uint64
	TrainedContext  int
	VocabSize       int
	EmbeddingSize   int
	Layers          int
	HasChatTemplate bool
	// ChatTemplate is the chat format in use: "model" (the model's own template), or
	// the built-in format's name or the template text used instead.
	ChatTemplate string
	// Template is the model's own Jinja chat template (tokenizer.chat_template) when
	// ChatTemplate is "model", else empty; the API renders chats with it.
	Template string
	// Pooling is true for embedding models whose context pools one vector per sequence.
	Pooling bool
	// Rerank is how a reranker (a context with rank pooling) lays out a query and a
	// document; nil for other models. Its Embeddings are the scores of its classes.
	Rerank *RerankLayout
	// Sampling is what the model's makers recommend (general.sampling.*, written
	// from its generation_config.json when it was converted).
	Sampling SamplingDefaults
	// Devices are the compute devices the engine found; GPULayers of Layers (plus the
	// output layer) are offloaded to the GPUs among them.
	Devices   []Device
	GPULayers int
	// Weights is where llama.cpp put the weights, in the order it reported
	// them: a buffer per kind of memory (CPU_Mapped, CPU_REPACK, AMX, CUDA0,
	// ...) and its size.
	Weights []WeightBuffer
}

// WeightBuffer is one of the buffers that hold a model's weights.
type WeightBuffer struct {
	Name  string `json:"name"` // llama.cpp's buffer type, e.g. "AMX", "CUDA0"
	Bytes uint64 `json:"bytes"`
}

// RerankLayout is how a reranker reads a query and a document as one sequence, as
// llama-server lays them out: the model's rerank prompt (Template) when it has one,
// else BOS query EOS SEP document EOS, each special token only where the
// vocabulary adds it (NoToken where it does not).
type RerankLayout struct {
	// Template is the model's tokenizer.chat_template.rerank, whose {query} and
	// {document} are replaced by the texts; its own control tokens are parsed
	// and none are added (the API reads a text that holds a control token's text
	// as plain text).
	Template      string
	BOS, EOS, SEP Token
	// Scores is how many class scores the model gives per sequence; the first is
	// the relevance.
	Scores int
}

// SamplingDefaults are sampling parameters a request starts from before its own;
// nil where nothing is said.
type SamplingDefaults struct {
	Temperature   *float64
	TopP          *float64
	TopK          *int
	MinP          *float64
	RepeatPenalty *float64
}

// Over returns d with the fields d leaves unset taken from base.
func (d SamplingDefaults) Over(base SamplingDefaults) SamplingDefaults {
	if d.Temperature == nil {
		d.Temperature = base.Temperature
	}
	if d.TopP == nil {
		d.TopP = base.TopP
	}
	if d.TopK == nil {
		d.TopK = base.TopK
	}
	if d.MinP == nil {
		d.MinP = base.MinP
	}
	if d.RepeatPenalty == nil {
		d.RepeatPenalty = base.RepeatPenalty
	}
	return d
}

// Device is a compute device: the CPU, or a GPU whose backend library was loaded.
type Device struct {
	Name        string `json:"name"`        // the backend's name, e.g. "CUDA0", "CPU"
	Description string `json:"description"` // e.g. "NVIDIA H200"
	Kind        string `json:"kind"`        // cpu, gpu, igpu or accel
	MemoryTotal uint64 `json:"memory_total_bytes"`
	MemoryFree  uint64 `json:"memory_free_bytes"` // when the model was loaded
}

// FormatBytes writes a memory size for people: "12.5 GiB", "512.0 MiB", "100 B".
func FormatBytes(b uint64) string {
	switch {
	case b >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(b)/(1<<30))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	}
	return fmt.Sprintf("%d B", b)
}

// GPU reports whether d has memory of its own to offload to.
func (d Device) GPU() bool { return d.Kind == "gpu" || d.Kind == "igpu" }

// Capacity describes the context the engine was created with.
type Capacity struct {
	Cells       int  // KV cells in the pool (n_ctx); with Unified every sequence draws on all of them
	CellsPerSeq int  // the most cells one sequence may use (n_ctx when unified, n_ctx/MaxSeqs otherwise)
	MaxSeqs     int  // sequence ids 0..MaxSeqs-1
	BatchTokens int  // the most tokens one Decode accepts (n_batch)
	Unified     bool // one cell pool shared by all sequences
	// PrefixReuse is true when a cached prefix of one sequence can serve another: the
	// model's memory is a plain attention KV cache. Recurrent, hybrid and
	// sliding-window models report false and run without cross-request reuse.
	PrefixReuse bool
	// PrefixSharing is true when SeqCopy of a partial range shares cells between
	// sequences (PrefixReuse in a unified pool). Without it a prefix is reused by
	// copying a whole stream.
	PrefixSharing bool
	// PoolsLast is true for an embedding context that pools each sequence's last
	// token over causal attention (last pooling, Qwen 3's rank pooling) with
	// PrefixReuse: what the last token computes does not change when the tokens
	// before it come from a cached prefix, so a sequence computes only its tail.
	PoolsLast bool
	// WholeMedia: an image's rows must be decoded together, in one batch (its
	// tokens attend to each other both ways: Gemma 3's projector), never
	// some of them from the prefix cache; MicroBatchTokens bounds them.
	WholeMedia       bool
	MicroBatchTokens int
	// MRoPE: the model places tokens by M-RoPE (Qwen2-VL's and its
	// successors'). A text row's position is one number, as elsewhere; an
	// image's rows share one position, each at its line and column within
	// the image (Batch.Grid), and the image spans Media.Positions positions,
	// fewer than its rows, so a sequence's positions are no longer its
	// tokens' indices. A text row must be placed after every position its
	// sequence holds, an image row not before (llama.cpp's rule), and an
	// image's cells can only be removed or copied together.
	MRoPE bool
	// MediaWidth is the width of an image's embedding rows when it is not
	// the model's EmbeddingSize (Qwen3-VL's carry features for several
	// layers); 0: EmbeddingSize.
	MediaWidth int
	// CellBytes is the size of one cell's K and V over every layer (0: unknown).
	CellBytes float64
}

// Batch is one forward pass: row i puts Tokens[i] at Pos[i] of sequence Seq[i], and
// Output[i] asks for its logits (or embeddings). Rows of different sequences mix freely.
// A Batch is plain data owned by the caller and may be reused after Decode returns.
type Batch struct {
	Tokens []Token
	Pos    []Pos
	Seq    []SeqID
	Output []bool
	// Adapter is the LoRA adapter every row is computed under: i for the
	// engine's i-th selectable adapter (1-based), 0 for none. An engine
	// without adapters refuses any other than 0.
	Adapter int
	// Embd, when not empty, has a row for every row of the batch: an
	// embedding the model reads in place of the row's token (an image's,
	// from a Projector), or nil for a token row. An embedding row's token is
	// its placeholder (Media), which only names it.
	Embd [][]float32
	// Grid, when not empty, has a row for every row of the batch: with
	// Capacity.MRoPE, an image row's line and column within its image,
	// added to its position for the height and width of M-RoPE ({0, 0} for
	// text rows).
	Grid [][2]Pos
}

// Add appends one row.
func (b *Batch) Add(t Token, p Pos, s SeqID, output bool) {
	b.Tokens = append(b.Tokens, t)
	b.Pos = append(b.Pos, p)
	b.Seq = append(b.Seq, s)
	b.Output = append(b.Output, output)
	if len(b.Embd) > 0 {
		b.Embd = append(b.Embd, nil)
	}
	if len(b.Grid) > 0 {
		b.Grid = append(b.Grid, [2]Pos{})
	}
}

// AddEmbd appends a row that reads embedding e (of the model's width) in
// place of a token; placeholder is its token in the prompt (Media).
func (b *Batch) AddEmbd(placeholder Token, e []float32, p Pos, s SeqID, output bool) {
	if len(b.Grid) > 0 {
		b.Grid = append(b.Grid, [2]Pos{})
	}
	b.addEmbd(placeholder, e, p, s, output)
}

// AddEmbdAt is AddEmbd for an M-RoPE image row (Capacity.MRoPE) at line y
// and column x of its image.
func (b *Batch) AddEmbdAt(placeholder Token, e []float32, p, y, x Pos, s SeqID, output bool) {
	for len(b.Grid) < b.Len() {
		b.Grid = append(b.Grid, [2]Pos{})
	}
	b.Grid = append(b.Grid, [2]Pos{y, x})
	b.addEmbd(placeholder, e, p, s, output)
}

func (b *Batch) addEmbd(placeholder Token, e []float32, p Pos, s SeqID, output bool) {
	for len(b.Embd) < b.Len() {
		b.Embd = append(b.Embd, nil)
	}
	b.Tokens = append(b.Tokens, placeholder)
	b.Pos = append(b.Pos, p)
	b.Seq = append(b.Seq, s)
	b.Output = append(b.Output, output)
	b.Embd = append(b.Embd, e)
}

// At returns row i's line and column within its image (Grid).
func (b *Batch) At(i int) (y, x Pos) {
	if i < len(b.Grid) {
		return b.Grid[i][0], b.Grid[i][1]
	}
	return 0, 0
}

// Embedded reports whether row i reads an embedding instead of its token.
func (b *Batch) Embedded(i int) bool { return i < len(b.Embd) && b.Embd[i] != nil }

// Len is the number of rows.
func (b *Batch) Len() int { return len(b.Tokens) }

// Check refuses, as llama.cpp does, a batch an engine of capacity c with a
// vocabulary of vocab tokens cannot take: empty or ragged, more rows than
// c.BatchTokens, tokens, sequence ids or positions out of range, embedding rows
// not of width values (width 0: an engine that reads none), and positions that
// do not follow on from what each sequence holds (last reports a sequence's highest
// position), in the batch too. Engines that model llama.cpp in Go (the simulator,
// test fakes) share it; errors wrap ErrInvalidInput.
func (b *Batch) Check(c Capacity, vocab, width int, last func(SeqID) (Pos, bool)) error {
	n := b.Len()
	switch {
	case n == 0:
		return fmt.Errorf("empty batch: %w", ErrInvalidInput)
	case len(b.Pos) != n || len(b.Seq) != n || len(b.Output) != n || len(b.Embd) != 0 && len(b.Embd) != n || len(b.Grid) != 0 && len(b.Grid) != n:
		return fmt.Errorf("ragged batch: %w", ErrInvalidInput)
	case n > c.BatchTokens:
		return fmt.Errorf("batch of %d rows exceeds %d: %w", n, c.BatchTokens, ErrInvalidInput)
	}
	next := map[SeqID]Pos{}
	for i := range n {
		t, s, p := b.Tokens[i], b.Seq[i], b.Pos[i]
		switch {
		case b.Embedded(i) && (width == 0 || len(b.Embd[i]) != width):
			return fmt.Errorf("row %d: an embedding of %d values, want %d: %w", i, len(b.Embd[i]), width, ErrInvalidInput)
		case !b.Embedded(i) && (t < 0 || int(t) >= vocab):
			return fmt.Errorf("row %d: token %d out of range: %w", i, t, ErrInvalidInput)
		case s < 0 || int(s) >= c.MaxSeqs:
			return fmt.Errorf("row %d: sequence %d out of range: %w", i, s, ErrInvalidInput)
		case p < 0 || int(p) >= c.CellsPerSeq:
			return fmt.Errorf("row %d: position %d beyond the context of %d: %w", i, p, c.CellsPerSeq, ErrInvalidInput)
		}
		want, ok := next[s]
		if !ok {
			if hi, held := last(s); held {
				want = hi + 1
			}
		}
		switch {
		case !c.MRoPE && p != want:
			return fmt.Errorf("row %d: sequence %d at position %d, want %d: %w", i, s, p, want, ErrInvalidInput)
		case c.MRoPE && (p < want-1 || p == want-1 && !b.Embedded(i)):
			// An image's rows share its first position; text moves on.
			return fmt.Errorf("row %d: sequence %d at position %d, want %d or more: %w", i, s, p, want, ErrInvalidInput)
		case len(b.Grid) > 0 && b.Grid[i] != [2]Pos{} && (!c.MRoPE || !b.Embedded(i)):
			return fmt.Errorf("row %d: a line and column, which only an M-RoPE engine's image rows have: %w", i, ErrInvalidInput)
		}
		next[s] = p + 1
	}
	return nil
}

// Keep keeps the rows i for which keep(i) is true, in order, dropping the
// others from every column. keep sees each row in order, before any row at
// or after it moves.
func (b *Batch) Keep(keep func(i int) bool) {
	n := 0
	for i := range b.Len() {
		if !keep(i) {
			continue
		}
		b.Tokens[n], b.Pos[n], b.Seq[n], b.Output[n] = b.Tokens[i], b.Pos[i], b.Seq[i], b.Output[i]
		if len(b.Embd) > 0 {
			b.Embd[n] = b.Embd[i]
		}
		if len(b.Grid) > 0 {
			b.Grid[n] = b.Grid[i]
		}
		n++
	}
	clear(b.Embd[min(n, len(b.Embd)):])
	b.Tokens, b.Pos, b.Seq, b.Output = b.Tokens[:n], b.Pos[:n], b.Seq[:n], b.Output[:n]
	b.Embd, b.Grid = b.Embd[:min(n, len(b.Embd))], b.Grid[:min(n, len(b.Grid))]
}

// Reset empties the batch, keeping its memory.
func (b *Batch) Reset() {
	b.Tokens, b.Pos, b.Seq, b.Output = b.Tokens[:0], b.Pos[:0], b.Seq[:0], b.Output[:0]
	clear(b.Embd)
	b.Embd, b.Grid = b.Embd[:0], b.Grid[:0]
}

// LogitsViewer is implemented by engines whose logits can be read by several
// goroutines at once, so that a scheduler can sample many sequences in parallel.
//
// Concurrency: only the Engine's owner calls LogitsView, like any other method. The
// slice it returns is a read-only view of engine memory that stays valid, and may be
// read from any goroutine, until the owner's next call of Decode or Close.
type LogitsViewer interface {
	// LogitsView returns the logits of output row i of the last Decode (as Logits).
	LogitsView(i int) ([]float32, error)
}

// ViewLogits implements Engine.Logits for a LogitsViewer: fn gets row i's view.
func ViewLogits(v LogitsViewer, i int, fn func(logits []float32)) error {
	l, err := v.LogitsView(i)
	if err != nil {
		return err
	}
	fn(l)
	return nil
}

// Engine is a loaded model with one inference context.
//
// Concurrency: an Engine is owned by one goroutine (the scheduler); none of its methods
// may be called concurrently with another, except Abort, which any goroutine may call at
// any time to make a running Decode return ErrAborted, and Vocab, whose result is safe
// for concurrent use. Close must not race with a Decode: Abort, wait for the owner to
// return, then Close. Close is safe to call twice.
//
// Memory: positions p0..p1 are half-open; p1 < 0 means "to the end".
type Engine interface {
	Info() ModelInfo
	Capacity() Capacity
	Vocab() Vocab

	// Decode runs one forward pass. ctx is checked before the pass starts and aborts it
	// when cancelled during the pass. On ErrNoKVSpace nothing was changed.
	Decode(ctx context.Context, b *Batch) error
	// Logits calls fn with the logits of row i of the last Decode's batch, a row
	// with Output set. The slice is a view of engine memory, valid only during fn:
	// copy what must outlive it.
	Logits(i int, fn func(logits []float32)) error
	// Embeddings returns the pooled embedding of a sequence after a Decode on a pooling
	// model, or a reranker's class scores (ModelInfo.Rerank); ErrUnsupported otherwise.
	Embeddings(s SeqID) ([]float32, error)

	// SeqRemove drops positions [p0, p1) of sequence s from memory; s < 0 means all.
	SeqRemove(s SeqID, p0, p1 Pos) error
	// SeqCopy makes positions [p0, p1) of src visible to dst as well. In a unified pool
	// this shares cells (no copy); in split mode only whole-stream copies are allowed.
	SeqCopy(src, dst SeqID, p0, p1 Pos) error
	// SeqKeep removes every sequence except s.
	SeqKeep(s SeqID) error
	// SeqShift adds delta to the positions in [p0, p1) of s (context shift).
	SeqShift(s SeqID, p0, p1, delta Pos) error
	// SeqPosRange returns the smallest and largest position of s; ok is false when s is empty.
	SeqPosRange(s SeqID) (min, max Pos, ok bool)
	// ClearMemory empties the KV memory of all sequences.
	ClearMemory() error

	// NewGrammar compiles a GBNF grammar for constrained sampling. With triggers it is
	// lazy: it constrains nothing until one of the triggers appears in the output,
	// and from then on constrains the output from that trigger's first byte (the
	// grammar's strings begin with a trigger).
	NewGrammar(gbnf string, triggers []Trigger) (Grammar, error)

	// Abort makes a Decode in progress (or the next one) return ErrAborted. Any goroutine.
	Abort()
	Close() error
}

// Vocab is a model's tokenizer and chat template.
//
// Concurrency: all methods are safe for concurrent use; HTTP handlers tokenize while the
// scheduler decodes.
type Vocab interface {
	Size() int
	BOS() Token
	EOS() Token
	// IsEOG reports whether t ends generation (EOS, EOT and the like).
	IsEOG(t Token) bool
	// AddBOS reports whether the model expects BOS at the start of a prompt.
	AddBOS() bool
	// FIM is the model's fill-in-the-middle tokens (code models).
	FIM() FIMTokens

	// Tokenize splits text; addSpecial adds BOS (and EOS) as the model wants, and
	// parseSpecial turns control-token text such as "<|im_start|>" into those tokens.
	Tokenize(text string, addSpecial, parseSpecial bool) ([]Token, error)
	// Piece is the raw bytes of one token (special tokens render as their text when
	// special is true, as nothing otherwise). Bytes may be part of a UTF-8 rune.
	Piece(t Token, special bool) ([]byte, error)
	// Detokenize renders whole sequences; removeSpecial drops BOS/EOS, unparseSpecial
	// renders control tokens as text.
	Detokenize(tokens []Token, removeSpecial, unparseSpecial bool) (string, error)

	// ApplyChatTemplate renders messages with the model's chat template (ChatML when it
	// has none), ending with the assistant's turn opened when addAssistant is set.
	ApplyChatTemplate(msgs []ChatMessage, addAssistant bool) (string, error)
}

// FIMTokens are a code model's fill-in-the-middle control tokens, NoToken
// where it has none: Pre, Suf and Mid lay out code before and after a gap and
// ask for the middle; Rep and Sep (Qwen2.5-Coder's repo name and file
// separator) put other files of the repository first; Pad fills.
type FIMTokens struct {
	Pre, Suf, Mid, Pad, Rep, Sep Token
}

// NoToken stands for a token a model does not have.
const NoToken Token = -1

// Infill reports whether the model can fill a gap (it has Pre, Suf and Mid).
func (f FIMTokens) Infill() bool { return f.Pre != NoToken && f.Suf != NoToken && f.Mid != NoToken }

// Repo reports whether the model takes other files of the repository first.
func (f FIMTokens) Repo() bool { return f.Rep != NoToken && f.Sep != NoToken }

// NoFIM is the FIMTokens of a model without any.
var NoFIM = FIMTokens{NoToken, NoToken, NoToken, NoToken, NoToken, NoToken}

// ChatMessage is one turn for ApplyChatTemplate.
type ChatMessage struct {
	Role    string
	Content string
}

// Grammar constrains sampling to the strings of a GBNF grammar.
//
// Concurrency: not safe for concurrent use; each request owns its own Grammar.
// Close is safe to call twice.
type Grammar interface {
	// Apply sets the logit of every candidate the grammar forbids next to -Inf.
	Apply(cands []TokenLogit)
	// Accept advances the grammar past t.
	Accept(t Token)
	Close() error
}

// Trigger starts a lazy grammar (Engine.NewGrammar) where its text appears in the
// output, as the text of its tokens without control tokens.
type Trigger struct {
	Text string
	// AtStart: only at the output's start, after any spaces, tabs and newlines.
	AtStart bool
	// Special: the output's text is read with control tokens written as their
	// text, for a trigger that is one ("[TOOL_CALLS]"). One such trigger makes
	// every trigger of the grammar read so.
	Special bool
}

// GBNFLiteral quotes s as a GBNF string literal.
func GBNFLiteral(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		b.WriteString(gbnfChar(r, false))
	}
	b.WriteByte('"')
	return b.String()
}

// TokenLogit is one candidate token and its logit.
type TokenLogit struct {
	Token Token
	Logit float32
}

// MaxImagePixels bounds one image's decoded size (24 megapixels, 72 MB of
// RGB): a projector scales every image down to its own size, so more only
// costs memory and time.
const MaxImagePixels = 24 << 20

// Image is a decoded picture: Width×Height pixels of 3 bytes (red, green,
// blue), row by row.
type Image struct {
	Width, Height int
	RGB           []byte
}

// Media is a non-text input of a prompt (an image) that the model reads as
// embeddings in place of tokens: the prompt's tokens [Pos, Pos+Len) are its
// placeholders (Placeholder), and Embd holds Len rows of the model's
// embedding width, one per token. (Pos is an index in the prompt, which is
// also the model's position except with Capacity.MRoPE.)
type Media struct {
	Pos, Len int
	Embd     []float32
	// Cols and Rows are, with Capacity.MRoPE, the image's grid: row i of
	// the media is at line i/Cols, column i%Cols (Batch.Grid); 0 otherwise.
	Cols, Rows int
}

// Positions is how far the media moves a sequence's positions on: its rows,
// or with M-RoPE the longer side of its grid.
func (m Media) Positions() int {
	if m.Cols > 0 {
		return max(m.Cols, m.Rows)
	}
	return m.Len
}

// Row returns the embedding read at prompt position p, which the media covers.
func (m Media) Row(p int) []float32 {
	w := len(m.Embd) / max(m.Len, 1)
	i := p - m.Pos
	return m.Embd[i*w : (i+1)*w : (i+1)*w]
}

// Placeholder is the token standing for row i of a media whose content (and
// shape) hashes to h: negative, so no vocabulary token, and a different one
// per row and content, so that the prefix cache, which keys blocks by their
// tokens, tells pictures apart as it tells texts apart, and takes the first
// rows of an image for all of it.
func Placeholder(h uint64, i int) Token {
	x := h + uint64(i+1)*0x9e3779b97f4a7c15 // splitmix64
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	x ^= x >> 31
	return Token(-2 - int64(x%0x7ffffffe)) // in [-2^31+1, -2]: never NoToken
}

// Projector reads images for a model: a multimodal projector (llama.cpp's
// mtmd) turns each into embeddings that the model reads in place of tokens.
//
// Concurrency: safe for concurrent use; it encodes one image at a time, on
// its own compute context, so encoding runs beside the engine's decoding.
// Layout, and a Prompt whose images are all in its cache, never wait for
// another prompt's encoding.
type Projector interface {
	// Marker is the text that stands for the next image in a prompt.
	Marker() string
	// Prompt tokenizes text, in which each Marker stands for the next of
	// images, as Vocab.Tokenize does, and encodes the images: each becomes a
	// run of placeholder tokens in the prompt and a Media in the order they
	// appear. A prompt of limit tokens or more (limit > 0) is refused with a
	// *PromptTooLongError before any image is encoded.
	Prompt(ctx context.Context, text string, images []Image, limit int, addSpecial, parseSpecial bool) ([]Token, []Media, error)
	// Layout is the prompt Prompt would make of text and images, its
	// images' placeholders in place, without encoding them.
	Layout(text string, images []Image, addSpecial, parseSpecial bool) ([]Token, error)
}

// PromptTooLongError is a prompt refused for its length before it was computed.
type PromptTooLongError struct{ Tokens, Limit int }

func (e *PromptTooLongError) Error() string {
	return fmt.Sprintf("prompt of %d tokens: at least the limit of %d", e.Tokens, e.Limit)
}
