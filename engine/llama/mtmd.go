package llama

/*
#include <stdlib.h>
#include <stdbool.h>
#include <stdint.h>
#include <stddef.h>
#include "llama.h"

// Declarations of llama.cpp's tools/mtmd/mtmd.h, which the pinned ollama
// module compiles into the library (its include directory is not on
// CGO_CPPFLAGS: adding it would change every cgo package's flags and rebuild
// llama.cpp). They are copied from that header as it is at the pinned
// version; mtmd_context_params must match it field for field.
typedef struct mtmd_context mtmd_context;
typedef struct mtmd_bitmap mtmd_bitmap;
typedef struct mtmd_input_chunk mtmd_input_chunk;
typedef struct mtmd_input_chunks mtmd_input_chunks;
typedef struct mtmd_image_tokens mtmd_image_tokens;
typedef struct mtmd_input_text {
	const char *text;
	bool add_special;
	bool parse_special;
} mtmd_input_text;
struct mtmd_context_params {
	bool use_gpu;
	bool print_timings;
	int n_threads;
	const char *image_marker;
	const char *media_marker;
	enum llama_flash_attn_type flash_attn_type;
	bool warmup;
	int image_min_tokens;
	int image_max_tokens;
};
enum { SHOAL_MTMD_CHUNK_TEXT = 0, SHOAL_MTMD_CHUNK_IMAGE = 1 };

struct mtmd_context_params mtmd_context_params_default(void);
mtmd_context *mtmd_init_from_file(const char *mmproj_fname, const struct llama_model *text_model, const struct mtmd_context_params ctx_params);
void mtmd_free(mtmd_context *ctx);
bool mtmd_decode_use_non_causal(mtmd_context *ctx);
bool mtmd_decode_use_mrope(mtmd_context *ctx);
bool mtmd_support_vision(mtmd_context *ctx);
mtmd_bitmap *mtmd_bitmap_init(uint32_t nx, uint32_t ny, const unsigned char *data);
void mtmd_bitmap_free(mtmd_bitmap *bitmap);
void mtmd_bitmap_set_id(mtmd_bitmap *bitmap, const char *id);
const char *mtmd_input_chunk_get_id(const mtmd_input_chunk *chunk);
mtmd_input_chunks *mtmd_input_chunks_init(void);
size_t mtmd_input_chunks_size(const mtmd_input_chunks *chunks);
const mtmd_input_chunk *mtmd_input_chunks_get(const mtmd_input_chunks *chunks, size_t idx);
void mtmd_input_chunks_free(mtmd_input_chunks *chunks);
int mtmd_input_chunk_get_type(const mtmd_input_chunk *chunk);
const llama_token *mtmd_input_chunk_get_tokens_text(const mtmd_input_chunk *chunk, size_t *n_tokens_output);
size_t mtmd_input_chunk_get_n_tokens(const mtmd_input_chunk *chunk);
llama_pos mtmd_input_chunk_get_n_pos(const mtmd_input_chunk *chunk);
const mtmd_image_tokens *mtmd_input_chunk_get_tokens_image(const mtmd_input_chunk *chunk);
size_t mtmd_image_tokens_get_nx(const mtmd_image_tokens *image_tokens);
size_t mtmd_image_tokens_get_ny(const mtmd_image_tokens *image_tokens);
int32_t mtmd_tokenize(mtmd_context *ctx, mtmd_input_chunks *output, const mtmd_input_text *text, const mtmd_bitmap **bitmaps, size_t n_bitmaps);
int32_t mtmd_encode_chunk(mtmd_context *ctx, const mtmd_input_chunk *chunk);
float *mtmd_get_output_embd(mtmd_context *ctx);
void mtmd_log_set(ggml_log_callback log_callback, void *user_data);
int32_t mtmd_helper_eval_chunks(mtmd_context *ctx, struct llama_context *lctx, const mtmd_input_chunks *chunks, llama_pos n_past, llama_seq_id seq_id, int32_t n_batch, bool logits_last, llama_pos *new_n_past);

extern void shoalLog(int level, char *text, void *user_data);

static void shoal_mtmd_install_log(void) {
	mtmd_log_set((ggml_log_callback)shoalLog, NULL);
}
*/
import "C"

import (
	"cmp"
	"container/list"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/shoal-ai/shoal/engine"
)

// Projector is a multimodal projector file (--mmproj) loaded for the
// engine's model through llama.cpp's mtmd. See engine.Projector for the
// concurrency rules; Close belongs to the Engine, which closes it first.
type Projector struct {
	// life guards ctx: a prompt's tokenizing, laying out and encoding hold
	// it to read, close to write.
	life sync.RWMutex
	// encode holds a token while an image chunk is encoded, one at a time
	// (mtmd keeps one output buffer). Tokenizing, laying out and taking an
	// image from the cache never wait for it: mtmd prepares a picture
	// (resizing, normalizing) from the projector's fixed parameters.
	encode chan struct{}
	ctx    *C.mtmd_context
	marker string
	width  int // the model's input embedding width
	vocab  *Vocab
	cache  embdCache // recent images' embeddings
	// encoded counts the image chunks encoded (not taken from the cache).
	encoded atomic.Int64
	// nonCausal: an image's tokens attend to each other both ways (Gemma
	// 3's), so an image is computed in one pass of its own
	// (engine.Capacity.WholeMedia).
	nonCausal bool
	causal    bool // the model's own attention, outside images
	// mrope: image tokens are placed by M-RoPE (Qwen2-VL's and its
	// successors'), each image a grid (engine.Capacity.MRoPE).
	mrope bool
}

// embdCache keeps the embeddings of recently encoded images (each chunk's,
// by its placeholders' hash), up to max bytes, the least recently used
// dropped first: a chat's later turns about a picture, whose KV the prefix
// cache may hold, or not, do not encode it again (vLLM keeps such a cache).
// The slices it hands out are shared and never written. It is safe for
// concurrent use.
type embdCache struct {
	mu        sync.Mutex
	max, used int
	order     list.List // of *embdEntry, most recent first
	byKey     map[uint64]*list.Element
}

type embdEntry struct {
	key  uint64
	embd []float32
}

// get returns the cached embedding of key if it has n values, else nil.
func (c *embdCache) get(key uint64, n int) []float32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[key]
	if !ok || len(el.Value.(*embdEntry).embd) != n {
		return nil
	}
	c.order.MoveToFront(el)
	return el.Value.(*embdEntry).embd
}

func (c *embdCache) put(key uint64, embd []float32) {
	size := 4 * len(embd)
	if size > c.max {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byKey == nil {
		c.byKey = map[uint64]*list.Element{}
	}
	if el, ok := c.byKey[key]; ok {
		c.used -= 4 * len(el.Value.(*embdEntry).embd)
		c.order.Remove(el)
	}
	for c.used+size > c.max {
		old := c.order.Back().Value.(*embdEntry)
		c.order.Remove(c.order.Back())
		delete(c.byKey, old.key)
		c.used -= 4 * len(old.embd)
	}
	c.byKey[key] = c.order.PushFront(&embdEntry{key, embd})
	c.used += size
}

var _ engine.Projector = (*Projector)(nil)

// openProjector loads path for the engine's model. One whose image tokens
// attend to each other both ways (Gemma 3's) is noted: Open then computes
// each image whole (engine.Capacity.WholeMedia) and takes it only for a
// model without cross-request prefix reuse. So is one that places image
// tokens by M-RoPE (Qwen2-VL's: an image's tokens share a position, each at
// its line and column; engine.Capacity.MRoPE).
func (e *Engine) openProjector(path string, threads, cacheBytes int, gpu bool) error {
	C.shoal_mtmd_install_log()
	var id [8]byte
	_, _ = rand.Read(id[:])
	// A marker of the process's own, so that no text a client sends can stand
	// for an image.
	marker := "<__media_" + hex.EncodeToString(id[:]) + "__>"
	cm := C.CString(marker)
	defer C.free(unsafe.Pointer(cm))
	cp := C.mtmd_context_params_default()
	cp.use_gpu = C.bool(gpu)
	cp.print_timings = false
	cp.n_threads = C.int(cmp.Or(threads, DefaultThreads()))
	cp.media_marker = cm
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var ctx *C.mtmd_context
	failed := llamaErrors(func() { ctx = C.mtmd_init_from_file(cpath, e.model, cp) })
	if ctx == nil {
		return fmt.Errorf("load projector %s: %s", path,
			cmp.Or(failed, "llama.cpp could not load it (not a multimodal projector GGUF, or one for another model)"))
	}
	switch rt := C.llama_model_rope_type(e.model); {
	case !bool(C.mtmd_support_vision(ctx)):
		C.mtmd_free(ctx)
		return fmt.Errorf("load projector %s: it reads no images (an audio projector): %w", path, engine.ErrUnsupported)
	case bool(C.mtmd_decode_use_mrope(ctx)) != (rt == C.LLAMA_ROPE_TYPE_MROPE || rt == C.LLAMA_ROPE_TYPE_IMROPE):
		// One would place images by M-RoPE and the other read them by
		// index (llama.cpp would read positions past the batch's).
		C.mtmd_free(ctx)
		return fmt.Errorf("load projector %s: it places images by M-RoPE (Qwen2-VL's and its successors') and the model does not, or the other way round: a projector for another model: %w",
			path, engine.ErrInvalidInput)
	}
	// Open gives it the vocabulary and the batch of embedding rows once the
	// context exists.
	e.proj = &Projector{ctx: ctx, encode: make(chan struct{}, 1), marker: marker, width: int(C.llama_model_n_embd_inp(e.model)),
		cache: embdCache{max: cacheBytes}, nonCausal: bool(C.mtmd_decode_use_non_causal(ctx)), mrope: bool(C.mtmd_decode_use_mrope(ctx))}
	return nil
}

// Projector returns the engine's projector, nil when it has none.
func (e *Engine) Projector() *Projector { return e.proj }

// Marker is the text that stands for an image in a prompt.
func (p *Projector) Marker() string { return p.marker }

// Prompt implements engine.Projector.
func (p *Projector) Prompt(ctx context.Context, text string, images []engine.Image, limit int, addSpecial, parseSpecial bool) ([]engine.Token, []engine.Media, error) {
	var toks []engine.Token
	var media []engine.Media
	err := p.tokenize(text, images, addSpecial, parseSpecial, func(segs []segment) error {
		var err error
		toks, media, err = p.layOut(ctx, segs, limit)
		return err
	})
	return toks, media, err
}

// Layout implements engine.Projector.
func (p *Projector) Layout(text string, images []engine.Image, addSpecial, parseSpecial bool) ([]engine.Token, error) {
	var toks []engine.Token
	err := p.tokenize(text, images, addSpecial, parseSpecial, func(segs []segment) error {
		var err error
		toks, _, err = p.walk(segs, func(ch *C.mtmd_input_chunk, m *chunkMedia) error { return nil })
		return err
	})
	return toks, err
}

// segment is a run of a prompt: text's tokens, or an image's chunks as mtmd
// lays it out (with the text some projectors put around an image).
type segment struct {
	toks   []engine.Token
	image  bool
	chunks *C.mtmd_input_chunks // an image's
}

func countTokens(segs []segment) int {
	total := 0
	for _, sg := range segs {
		total += len(sg.toks)
		if sg.chunks != nil {
			for i := range int(C.mtmd_input_chunks_size(sg.chunks)) {
				total += int(C.mtmd_input_chunk_get_n_tokens(C.mtmd_input_chunks_get(sg.chunks, C.size_t(i))))
			}
		}
	}
	return total
}

// tokenize splits text at the markers into segments and calls fn with them,
// holding the projector open (not its encoder). The text between markers is
// tokenized here, as mtmd tokenizes it, and each image by mtmd alone: mtmd
// reads its own deprecated marker ("<__image__>") in a text as an image's
// place, which a client's text may hold.
func (p *Projector) tokenize(text string, images []engine.Image, addSpecial, parseSpecial bool, fn func([]segment) error) error {
	p.life.RLock()
	defer p.life.RUnlock()
	if p.ctx == nil { // closed: the vocabulary is gone too
		return engine.ErrClosed
	}
	pieces := strings.Split(text, p.marker)
	if len(pieces) != len(images)+1 {
		return fmt.Errorf("tokenize: %d images for a prompt with %d places for them: %w", len(images), len(pieces)-1, engine.ErrInvalidInput)
	}
	ids := make([]string, len(images))
	for i, im := range images {
		if im.Width < 1 || im.Height < 1 || im.Width*im.Height > engine.MaxImagePixels || len(im.RGB) != 3*im.Width*im.Height {
			return fmt.Errorf("image %d: %d×%d pixels with %d bytes: want 1 to %d pixels of 3 bytes: %w",
				i, im.Width, im.Height, len(im.RGB), engine.MaxImagePixels, engine.ErrInvalidInput)
		}
		h := sha256.New()
		_ = binary.Write(h, binary.LittleEndian, [2]uint32{uint32(im.Width), uint32(im.Height)})
		h.Write(im.RGB)
		ids[i] = hex.EncodeToString(h.Sum(nil)[:8])
	}
	// As mtmd lays a prompt out: BOS first and EOS last where the vocabulary
	// adds them, the pieces tokenized without.
	segs := make([]segment, 0, 2*len(pieces)+2)
	if addSpecial && p.vocab.AddBOS() {
		segs = append(segs, segment{toks: []engine.Token{p.vocab.BOS()}})
	}
	for i, piece := range pieces {
		if piece != "" {
			toks, err := p.vocab.Tokenize(piece, false, parseSpecial)
			if err != nil {
				return fmt.Errorf("tokenize: %w", err)
			}
			segs = append(segs, segment{toks: toks})
		}
		if i < len(images) {
			segs = append(segs, segment{image: true})
		}
	}
	if addSpecial && bool(C.llama_vocab_get_add_eos(p.vocab.v)) {
		segs = append(segs, segment{toks: []engine.Token{p.vocab.EOS()}})
	}
	cm := C.CString(p.marker)
	defer C.free(unsafe.Pointer(cm))
	in := C.mtmd_input_text{text: cm, add_special: false, parse_special: true}

	k := 0
	for i := range segs {
		if !segs[i].image {
			continue
		}
		im := images[k]
		b := C.mtmd_bitmap_init(C.uint32_t(im.Width), C.uint32_t(im.Height), (*C.uchar)(unsafe.Pointer(&im.RGB[0])))
		id := C.CString(ids[k])
		C.mtmd_bitmap_set_id(b, id)
		C.free(unsafe.Pointer(id))
		chunks := C.mtmd_input_chunks_init()
		defer C.mtmd_input_chunks_free(chunks)
		var rc C.int32_t
		failed := llamaErrors(func() { rc = C.mtmd_tokenize(p.ctx, chunks, &in, &b, 1) })
		C.mtmd_bitmap_free(b)
		if rc != 0 {
			return fmt.Errorf("tokenize image %d: llama.cpp could not prepare it (status %d): %s: %w", k, int(rc), failed, engine.ErrInvalidInput)
		}
		segs[i].chunks = chunks
		k++
	}
	return fn(segs)
}

// layOut encodes the images (or takes them from the cache) and returns the
// prompt and its media, refusing one of limit tokens or more.
func (p *Projector) layOut(ctx context.Context, segs []segment, limit int) ([]engine.Token, []engine.Media, error) {
	if total := countTokens(segs); limit > 0 && total >= limit {
		return nil, nil, &engine.PromptTooLongError{Tokens: total, Limit: limit}
	}
	return p.walk(segs, func(ch *C.mtmd_input_chunk, m *chunkMedia) error {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("encode images: %w", err)
		}
		if m.Embd = p.cache.get(m.hash, m.Len*p.width); m.Embd != nil {
			return nil
		}
		select {
		case p.encode <- struct{}{}:
			defer func() { <-p.encode }()
		case <-ctx.Done():
			return fmt.Errorf("wait to encode images: %w", ctx.Err())
		}
		// Another prompt may have encoded the same picture meanwhile.
		if m.Embd = p.cache.get(m.hash, m.Len*p.width); m.Embd != nil {
			return nil
		}
		var rc C.int32_t
		if failed := llamaErrors(func() { rc = C.mtmd_encode_chunk(p.ctx, ch) }); rc != 0 {
			return fmt.Errorf("encode image chunk %d: llama.cpp failed: %s", m.Pos, failed)
		}
		p.encoded.Add(1)
		out := C.mtmd_get_output_embd(p.ctx)
		m.Embd = append([]float32(nil), unsafe.Slice((*float32)(unsafe.Pointer(out)), m.Len*p.width)...)
		p.cache.put(m.hash, m.Embd)
		return nil
	})
}

// chunkMedia is an image chunk's media and the hash of its placeholders.
type chunkMedia struct {
	engine.Media
	hash uint64
}

// walk lays the segments out as a prompt, each image chunk as its
// placeholders, and calls image with each image chunk's media (its
// embeddings to fill in, or not) in order. A chunk's placeholders come from
// its image's content and the chunk's place among that image's chunks (a
// projector may slice an image).
func (p *Projector) walk(segs []segment, image func(*C.mtmd_input_chunk, *chunkMedia) error) ([]engine.Token, []engine.Media, error) {
	toks := make([]engine.Token, 0, countTokens(segs))
	var media []engine.Media
	seen := map[string]int{}
	for _, sg := range segs {
		toks = append(toks, sg.toks...)
		if !sg.image {
			continue
		}
		for i := range int(C.mtmd_input_chunks_size(sg.chunks)) {
			ch := C.mtmd_input_chunks_get(sg.chunks, C.size_t(i))
			if C.mtmd_input_chunk_get_type(ch) == C.SHOAL_MTMD_CHUNK_TEXT {
				var nt C.size_t
				tp := C.mtmd_input_chunk_get_tokens_text(ch, &nt)
				for _, t := range unsafe.Slice(tp, int(nt)) {
					toks = append(toks, engine.Token(t))
				}
				continue
			}
			id := C.GoString(C.mtmd_input_chunk_get_id(ch))
			raw, err := hex.DecodeString(id)
			if err != nil || len(raw) != 8 {
				return nil, nil, fmt.Errorf("image chunk %d: llama.cpp lost its id %q", len(media), id)
			}
			seen[id]++
			nt, np := int(C.mtmd_input_chunk_get_n_tokens(ch)), int(C.mtmd_input_chunk_get_n_pos(ch))
			m := chunkMedia{engine.Media{Pos: len(toks), Len: nt}, binary.LittleEndian.Uint64(raw) + uint64(seen[id]-1)*0x632be59bd9b4e019}
			if p.mrope {
				it := C.mtmd_input_chunk_get_tokens_image(ch)
				m.Cols, m.Rows = int(C.mtmd_image_tokens_get_nx(it)), int(C.mtmd_image_tokens_get_ny(it))
			}
			if p.mrope && m.Cols*m.Rows != nt || m.Positions() != np {
				return nil, nil, fmt.Errorf("image chunk %d: %d tokens (a grid of %d×%d) over %d positions: %w", len(media), nt, m.Cols, m.Rows, np, engine.ErrUnsupported)
			}
			// Its shape too: the prefix cache takes an image's first rows
			// for the whole image (kvcache.Config.UncutMedia).
			m.hash ^= uint64(nt)<<40 ^ uint64(m.Cols)<<20 ^ uint64(m.Rows)
			if err := image(ch, &m); err != nil {
				return nil, nil, err
			}
			for j := range nt {
				toks = append(toks, engine.Placeholder(m.hash, j))
			}
			media = append(media, m.Media)
		}
	}
	return toks, media, nil
}

// reference decodes text with images on sequence s as llama.cpp's own
// helper does (mtmd_helper_eval_chunks: mtmd's layout, positions and
// passes), for the tests to hold the engine's own path against. It returns
// the last row's logits and the position after the prompt. Only for tests:
// it bypasses Decode's checks and the rows' mapping.
func (p *Projector) reference(e *Engine, text string, images []engine.Image, s engine.SeqID) (logits []float32, next engine.Pos, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	p.life.RLock()
	defer p.life.RUnlock()
	p.encode <- struct{}{}
	defer func() { <-p.encode }()
	ct := C.CString(text)
	defer C.free(unsafe.Pointer(ct))
	in := C.mtmd_input_text{text: ct, add_special: true, parse_special: false}
	bitmaps := make([]*C.mtmd_bitmap, len(images))
	for i, im := range images {
		bitmaps[i] = C.mtmd_bitmap_init(C.uint32_t(im.Width), C.uint32_t(im.Height), (*C.uchar)(unsafe.Pointer(&im.RGB[0])))
		defer C.mtmd_bitmap_free(bitmaps[i])
	}
	chunks := C.mtmd_input_chunks_init()
	defer C.mtmd_input_chunks_free(chunks)
	cb := (**C.mtmd_bitmap)(C.malloc(C.size_t(len(images)) * C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(cb))
	copy(unsafe.Slice(cb, len(images)), bitmaps)
	if rc := C.mtmd_tokenize(p.ctx, chunks, &in, cb, C.size_t(len(images))); rc != 0 {
		return nil, 0, fmt.Errorf("reference: tokenize: status %d", int(rc))
	}
	var np C.llama_pos
	if rc := C.mtmd_helper_eval_chunks(p.ctx, e.ctx, chunks, 0, C.llama_seq_id(s), C.int32_t(e.cap.BatchTokens), true, &np); rc != 0 {
		return nil, 0, fmt.Errorf("reference: eval: status %d", int(rc))
	}
	out := C.llama_get_logits_ith(e.ctx, -1)
	return append([]float32(nil), unsafe.Slice((*float32)(unsafe.Pointer(out)), e.vocab.Size())...), engine.Pos(np), nil
}

// close frees the projector; Engine.Close calls it.
func (p *Projector) close() {
	p.life.Lock()
	defer p.life.Unlock()
	if p.ctx != nil {
		C.mtmd_free(p.ctx)
		p.ctx = nil
	}
}
