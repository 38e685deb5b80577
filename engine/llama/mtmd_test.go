package llama

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

// openVision opens models.Small() with a generated projector.
func openVision(t *testing.T) *Engine {
	t.Helper()
	return openWithProjector(t, models.Small())
}

// openWithProjector opens spec's model with a projector generated for it.
func openWithProjector(t *testing.T, spec models.Spec) *Engine {
	t.Helper()
	proj := filepath.Join(t.TempDir(), "mmproj.gguf")
	if err := models.GenerateProjector(proj, spec, 0); err != nil {
		t.Fatal(err)
	}
	return openTest(t, spec, func(c *Config) { c.Projector = proj })
}

// picture is a w×h image of one colour with a diagonal line of another.
func picture(w, h int, bg, line [3]byte) engine.Image {
	im := engine.Image{Width: w, Height: h, RGB: make([]byte, 3*w*h)}
	for y := range h {
		for x := range w {
			c := bg
			if x == y*w/h {
				c = line
			}
			copy(im.RGB[3*(y*w+x):], c[:])
		}
	}
	return im
}

// imagePrompt is a prompt laid out with its image.
type imagePrompt struct {
	toks  []engine.Token
	media []engine.Media
}

// picturePrompts lays out three chat prompts, each with a picture of its own
// and the text "Describe picture n" with n = number(i).
func picturePrompts(t *testing.T, p *Projector, number func(i int) int) []imagePrompt {
	t.Helper()
	pics := []engine.Image{
		picture(40, 30, [3]byte{200, 30, 30}, [3]byte{0, 0, 0}),
		picture(25, 50, [3]byte{20, 40, 220}, [3]byte{255, 255, 255}),
		picture(64, 64, [3]byte{20, 200, 20}, [3]byte{90, 0, 90}),
	}
	var out []imagePrompt
	for i, im := range pics {
		text := fmt.Sprintf("USER: %s\nDescribe picture %d. ASSISTANT:", p.Marker(), number(i))
		toks, media, err := p.Prompt(context.Background(), text, []engine.Image{im}, 0, true, false)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, imagePrompt{toks, media})
	}
	return out
}

// promptRows adds rows [from, to) of a prompt with media to b for sequence s.
func promptRows(b *engine.Batch, toks []engine.Token, media []engine.Media, s engine.SeqID, from, to int) {
	for p := from; p < to; p++ {
		out := p == len(toks)-1
		if toks[p] < 0 {
			for _, m := range media {
				if p >= m.Pos && p < m.Pos+m.Len {
					b.AddEmbd(toks[p], m.Row(p), engine.Pos(p), s, out)
				}
			}
			continue
		}
		b.Add(toks[p], engine.Pos(p), s, out)
	}
}

// lastLogits decodes the prompt on sequence s in chunks of chunk rows (from
// position from, the rest being in memory) and returns its last row's logits.
func lastLogits(t *testing.T, e *Engine, toks []engine.Token, media []engine.Media, s engine.SeqID, from, chunk int) []float32 {
	t.Helper()
	var out []float32
	for p := from; p < len(toks); p += chunk {
		var b engine.Batch
		end := min(p+chunk, len(toks))
		promptRows(&b, toks, media, s, p, end)
		if end == len(toks) {
			out = decodeLast(t, e, &b)
		} else if err := e.Decode(context.Background(), &b); err != nil {
			t.Fatalf("decode rows %d..%d: %v", p, end, err)
		}
	}
	return out
}

// decodeLast decodes b on e and returns a copy of its last row's logits.
func decodeLast(t *testing.T, e *Engine, b *engine.Batch) []float32 {
	t.Helper()
	if err := e.Decode(context.Background(), b); err != nil {
		t.Fatalf("decode %d rows: %v", b.Len(), err)
	}
	var out []float32
	if err := e.Logits(b.Len()-1, func(l []float32) { out = slices.Clone(l) }); err != nil {
		t.Fatal(err)
	}
	return out
}

// generateAll runs the request of each prompt on s, one after another.
func generateAll[P any](t *testing.T, s *scheduler.Scheduler, prompts []P, req func(P) *scheduler.Request) []genResult {
	t.Helper()
	var out []genResult
	for _, pr := range prompts {
		g := generate(context.Background(), s, req(pr))
		if g.err != nil {
			t.Fatal(g.err)
		}
		out = append(out, g)
	}
	return out
}

// TestImages: an image becomes placeholder tokens and embeddings the model
// reads in their place, and what it computes does not depend on how the rows
// are batched, on other sequences beside it or on a prefix taken from another
// sequence's cells; another picture gives other logits.
func TestImages(t *testing.T) {
	e := openVision(t)
	p := e.Projector()
	ctx := context.Background()
	red := picture(40, 30, [3]byte{200, 30, 30}, [3]byte{0, 0, 0})
	blue := picture(25, 50, [3]byte{20, 40, 220}, [3]byte{255, 255, 255})
	text := "USER: " + p.Marker() + "\nWhat is in this picture? ASSISTANT:"
	toks, media, err := p.Prompt(ctx, text, []engine.Image{red}, 0, true, false)
	if err != nil {
		t.Fatal(err)
	}
	side := models.ProjectorImageSize / models.ProjectorPatchSize
	if l, err := p.Layout(text, []engine.Image{red}, true, false); err != nil || !slices.Equal(l, toks) {
		t.Errorf("Layout: %v (%v), Prompt made %v", l, err, toks)
	}
	if len(media) != 1 || media[0].Len != side*side || len(media[0].Embd) != media[0].Len*e.Info().EmbeddingSize {
		t.Fatalf("media %+v: want one image of %d rows of %d", media, side*side, e.Info().EmbeddingSize)
	}
	m := media[0]
	head := tokenize(t, e, "USER: ")
	if m.Pos != len(head) {
		t.Errorf("image at %d, want after the %d tokens of its text", m.Pos, len(head))
	}
	for i, tk := range toks {
		if in := i >= m.Pos && i < m.Pos+m.Len; in != (tk < 0) {
			t.Fatalf("token %d at %d: placeholders are the image's rows only", tk, i)
		}
	}
	again, againMedia, _ := p.Prompt(ctx, text, []engine.Image{red}, 0, true, false)
	if &againMedia[0].Embd[0] != &m.Embd[0] {
		t.Error("the same picture again was encoded again, not taken from the projector's cache")
	}
	other, otherMedia, err := p.Prompt(ctx, text, []engine.Image{blue}, 0, true, false)
	if err != nil {
		t.Fatal(err)
	}
	if again[m.Pos] != toks[m.Pos] || other[m.Pos] == toks[m.Pos] {
		t.Errorf("placeholders: the same picture %d and %d, another %d: want equal, then different", toks[m.Pos], again[m.Pos], other[m.Pos])
	}

	whole := lastLogits(t, e, toks, media, 0, 0, len(toks))
	tol := max(4*kernelNoise(t, e), 1e-3)
	if err := e.ClearMemory(); err != nil {
		t.Fatal(err)
	}
	// Chunks of 5 rows cut the image and mix text and image rows in a batch.
	if d := maxAbsDiff(whole, lastLogits(t, e, toks, media, 0, 0, 5)); d > tol {
		t.Errorf("in chunks of 5 rows: logits move by %.3g (tolerance %.3g)", d, tol)
	}
	blueLogits := lastLogits(t, e, other, otherMedia, 1, 0, len(other))
	if d := maxAbsDiff(whole, blueLogits); d < 10*tol {
		t.Errorf("another picture moves the logits by %.3g only: the image is not read", d)
	}

	// Three sequences in one batch: the two pictures and a text.
	if err := e.ClearMemory(); err != nil {
		t.Fatal(err)
	}
	plain := tokenize(t, e, testPrompts[0])
	var b engine.Batch
	promptRows(&b, toks, media, 0, 0, len(toks))
	rows := []int{b.Len() - 1}
	for p := range plain {
		b.Add(plain[p], engine.Pos(p), 2, p == len(plain)-1)
	}
	rows = append(rows, b.Len()-1)
	promptRows(&b, other, otherMedia, 1, 0, len(other))
	rows = append(rows, b.Len()-1)
	if err := e.Decode(ctx, &b); err != nil {
		t.Fatal(err)
	}
	for k, want := range [][]float32{whole, nil, blueLogits} {
		if want == nil {
			continue
		}
		if err := e.Logits(rows[k], func(l []float32) {
			if d := maxAbsDiff(want, l); d > tol {
				t.Errorf("batched with others, row %d: logits move by %.3g (tolerance %.3g)", rows[k], d, tol)
			}
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Logits(0, func([]float32) {}); err == nil {
		t.Error("logits of a row before the image: want an error")
	}

	// A prefix through the image taken from sequence 0's cells.
	cut := m.Pos + m.Len + 2
	if err := e.SeqCopy(0, 3, 0, engine.Pos(cut)); err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(whole, lastLogits(t, e, toks, media, 3, cut, len(toks))); d > tol {
		t.Errorf("from a shared prefix: logits move by %.3g (tolerance %.3g)", d, tol)
	}
}

// TestImageRefusals: bad images, prompts and batches are refused, and the
// engine works on.
func TestImageRefusals(t *testing.T) {
	e := openVision(t)
	p := e.Projector()
	ctx := context.Background()
	im := picture(8, 8, [3]byte{1, 2, 3}, [3]byte{4, 5, 6})
	text := "look: " + p.Marker() + " now"
	for name, c := range map[string]struct {
		text   string
		images []engine.Image
	}{
		"no place for the image":  {"no marker", []engine.Image{im}},
		"no image for the marker": {text, nil},
		"empty image":             {text, []engine.Image{{Width: 0, Height: 0}}},
		"short pixels":            {text, []engine.Image{{Width: 4, Height: 4, RGB: make([]byte, 10)}}},
		"huge":                    {text, []engine.Image{{Width: 1 << 16, Height: 1 << 16}}},
	} {
		if _, _, err := p.Prompt(ctx, c.text, c.images, 0, true, false); !errors.Is(err, engine.ErrInvalidInput) {
			t.Errorf("%s: %v, want ErrInvalidInput", name, err)
		}
	}
	// llama.cpp's markers, the default and the deprecated one, are text like
	// any other.
	for _, m := range []string{"<__media__>", "<__image__>"} {
		toks, media, err := p.Prompt(ctx, m+" "+text, []engine.Image{im}, 0, true, false)
		if err != nil || len(media) != 1 || toks[0] != e.Vocab().BOS() || toks[1] < 0 {
			t.Fatalf("%s in the text: %v, %d images, tokens %v", m, err, len(media), toks[:4])
		}
	}
	// An image first: BOS, then the image.
	if toks, media, err := p.Prompt(ctx, p.Marker()+" after", []engine.Image{im}, 0, true, false); err != nil || toks[0] != e.Vocab().BOS() || media[0].Pos != 1 {
		t.Fatalf("an image first: %v, tokens %v", err, toks[:3])
	}
	toks, media, err := p.Prompt(ctx, text, []engine.Image{im}, 0, true, false)
	if err != nil {
		t.Fatal(err)
	}
	var tooLong *engine.PromptTooLongError
	if _, _, err := p.Prompt(ctx, text, []engine.Image{im}, len(toks), true, false); !errors.As(err, &tooLong) || tooLong.Tokens != len(toks) {
		t.Errorf("at the limit: %v, want a PromptTooLongError of %d tokens", err, len(toks))
	}
	var b engine.Batch
	promptRows(&b, toks, media, 0, 0, len(toks))
	b.Output[media[0].Pos] = true
	if err := e.Decode(ctx, &b); !errors.Is(err, engine.ErrInvalidInput) {
		t.Errorf("output on an image row: %v, want ErrInvalidInput", err)
	}
	b.Output[media[0].Pos] = false
	b.Embd[media[0].Pos] = b.Embd[media[0].Pos][:3]
	if err := e.Decode(ctx, &b); !errors.Is(err, engine.ErrInvalidInput) {
		t.Errorf("a short embedding: %v, want ErrInvalidInput", err)
	}
	if _, _, ok := e.SeqPosRange(0); ok {
		t.Error("a refused batch left cells")
	}
	lastLogits(t, e, toks, media, 0, 0, len(toks))

	// A projector for another model, a file that is none, and embeddings.
	other := filepath.Join(t.TempDir(), "tiny-mmproj.gguf")
	if err := models.GenerateProjector(other, models.Tiny(), 0); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		mod  func(*Config)
		want string
	}{
		"another model's": {func(c *Config) { c.Projector = other }, "n_embd"},
		"not a projector": {func(c *Config) { c.Projector = genModel(t, models.Tiny()) }, "load projector"},
		"embeddings":      {func(c *Config) { c.Projector, c.Embeddings, c.Pooling = other, true, "mean" }, "not for embeddings"},
	} {
		cfg := DefaultConfig(genModel(t, models.Small()))
		cfg.ContextCells, cfg.MaxSeqs, cfg.Threads = 1024, 4, 2
		c.mod(&cfg)
		if e, err := Open(cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			if e != nil {
				e.Close()
			}
			t.Errorf("%s: %v, want an error saying %q", name, err, c.want)
		}
	}

	plain := openTest(t, models.Tiny(), nil)
	var pb engine.Batch
	pb.AddEmbd(-5, make([]float32, plain.Info().EmbeddingSize), 0, 0, true)
	if err := plain.Decode(ctx, &pb); !errors.Is(err, engine.ErrInvalidInput) {
		t.Errorf("an embedding row without a projector: %v, want ErrInvalidInput", err)
	}
}

// TestSchedulerImages: requests with images run through the scheduler
// concurrently, in chunks that cut their images, with the same greedy output
// as each alone; a second request for a picture takes the first's cached
// prefix through the image and answers the same, and another picture
// answers otherwise.
func TestSchedulerImages(t *testing.T) {
	e := openVision(t)
	ctx := context.Background()
	// Two prompts of one text, with other pictures.
	prompts := picturePrompts(t, e.Projector(), func(i int) int { return i % 2 })
	req := func(pr imagePrompt) *scheduler.Request {
		r := &scheduler.Request{Prompt: pr.toks, Media: pr.media, MaxTokens: 12, IgnoreEOS: true}
		r.Sampling.TopLogprobs = 2 // the margins of ties
		return r
	}
	tie := tieMargin(t, e)
	// Alone, with a step budget of 7 tokens: every image is cut over steps.
	s := startSched(t, e, func(c *scheduler.Config) { c.MaxBatchTokens, c.MaxRunning = 7, 4; c.KV.Caching = false })
	alone := generateAll(t, s, prompts, req)
	if slices.Equal(alone[0].tokens, alone[1].tokens) {
		t.Errorf("two pictures, one answer %v: the image is not read", alone[0].tokens)
	}
	e2 := openVision(t)
	s2 := startSched(t, e2, func(c *scheduler.Config) { c.MaxRunning = 8 })
	var wg sync.WaitGroup
	together := make([]genResult, 2*len(prompts))
	for i := range together {
		wg.Go(func() { together[i] = generate(ctx, s2, req(prompts[i%len(prompts)])) })
	}
	wg.Wait()
	cachedAny := false
	for i, g := range together {
		if g.err != nil {
			t.Fatal(g.err)
		}
		sameGreedy(t, fmt.Sprintf("request %d together", i), g.tokens, alone[i%len(prompts)].ref(), tie)
		cachedAny = cachedAny || g.cached > prompts[i%len(prompts)].media[0].Pos
	}
	again := generate(ctx, s2, req(prompts[0]))
	if again.err != nil {
		t.Errorf("again: %v", again.err)
	}
	sameGreedy(t, "again", again.tokens, alone[0].ref(), tie)
	m := prompts[0].media[0]
	if again.cached < m.Pos+m.Len {
		t.Errorf("again: %d tokens cached, want the prefix through the image (%d)", again.cached, m.Pos+m.Len)
	}
	t.Logf("cached through an image while computing together: %v; again: %d of %d", cachedAny, again.cached, len(prompts[0].toks))

	// With n-gram proposals (whose lookups run over the prompt, placeholders
	// included): the same output.
	e3 := openVision(t)
	s3 := startSched(t, e3, func(c *scheduler.Config) { c.MaxRunning, c.Spec.Tokens = 8, 4 })
	for i, pr := range prompts {
		g := generate(ctx, s3, req(pr))
		if g.err != nil {
			t.Errorf("with proposals, prompt %d: %v", i, g.err)
		}
		sameGreedy(t, fmt.Sprintf("with proposals, prompt %d", i), g.tokens, alone[i].ref(), tie)
	}

	// Refused: an image's rows out of place, or text missing after it.
	bad := req(prompts[0])
	bad.Media = []engine.Media{{Pos: m.Pos + 1, Len: m.Len, Embd: m.Embd}}
	if _, err := s2.Submit(ctx, bad); err == nil {
		t.Error("media out of place: want an error")
	}
	bad = req(prompts[0])
	bad.Prompt = bad.Prompt[:m.Pos+m.Len]
	if _, err := s2.Submit(ctx, bad); err == nil {
		t.Error("an image at the prompt's end: want an error")
	}
}

// TestEmbdCache: the projector's cache keeps what fits, the most recently
// used first, and hands back only embeddings of the size asked for.
func TestEmbdCache(t *testing.T) {
	c := embdCache{max: 4 * 10}
	c.put(1, make([]float32, 4))
	c.put(2, make([]float32, 4))
	if c.get(1, 4) == nil || c.get(1, 5) != nil {
		t.Fatal("get")
	}
	c.put(3, make([]float32, 4)) // over: 2, the least recently used, goes
	if c.get(2, 4) != nil || c.get(1, 4) == nil || c.get(3, 4) == nil || c.used != 32 {
		t.Fatalf("after eviction: used %d", c.used)
	}
	c.put(4, make([]float32, 11)) // larger than the whole cache: not kept
	c.put(3, make([]float32, 2))  // replaced
	if c.get(4, 11) != nil || c.get(3, 2) == nil || c.used != 24 || c.order.Len() != 2 {
		t.Fatalf("used %d, %d entries", c.used, c.order.Len())
	}
	var off embdCache // 0 bytes: keeps nothing
	off.put(1, make([]float32, 1))
	if off.get(1, 1) != nil {
		t.Fatal("a cache of 0 bytes kept an entry")
	}
}

// TestProjectorWaitsOnlyToEncode: while an image is being encoded, another
// prompt's layout and a prompt whose picture is cached go on; a prompt that
// must encode waits its turn, or for its context.
func TestProjectorWaitsOnlyToEncode(t *testing.T) {
	e := openVision(t)
	p := e.Projector()
	cached := picture(40, 30, [3]byte{200, 30, 30}, [3]byte{0, 0, 0})
	other := picture(25, 50, [3]byte{20, 40, 220}, [3]byte{255, 255, 255})
	text := "USER: " + p.Marker() + "\nWhat is it? ASSISTANT:"
	want, _, err := p.Prompt(context.Background(), text, []engine.Image{cached}, 0, true, false)
	if err != nil {
		t.Fatal(err)
	}
	wantOther, err := p.Layout(text, []engine.Image{other}, true, false)
	if err != nil {
		t.Fatal(err)
	}

	p.encode <- struct{}{} // an encoding in progress
	done := make(chan error, 1)
	go func() {
		toks, err := p.Layout(text, []engine.Image{other}, true, false)
		if err == nil && !slices.Equal(toks, wantOther) {
			err = errors.New("layout changed")
		}
		if err == nil {
			toks, _, err = p.Prompt(context.Background(), text, []engine.Image{cached}, 0, true, false)
		}
		if err == nil && !slices.Equal(toks, want) {
			err = errors.New("cached prompt changed")
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		<-p.encode // so that the engine closes
		t.Fatal("Layout or a cached picture's Prompt waited for another prompt's encoding")
	}

	// Three prompts with the same new picture wait for the encoder; one gives
	// up when its context ends; of the other two, once the encoder is free,
	// one encodes the picture and the other takes it from the cache.
	fresh := picture(64, 64, [3]byte{20, 200, 20}, [3]byte{90, 0, 90})
	waiting := func() (*askedCtx, chan error) {
		c := &askedCtx{Context: context.Background(), asked: make(chan struct{}), done: make(chan struct{})}
		errs := make(chan error, 1)
		go func() {
			_, media, err := p.Prompt(c, text, []engine.Image{fresh}, 0, true, false)
			if err == nil && (len(media) != 1 || media[0].Embd == nil) {
				err = fmt.Errorf("%d media, want 1 with its embeddings", len(media))
			}
			errs <- err
		}()
		select {
		case <-c.asked: // it waits for the encoder
		case <-time.After(time.Minute):
			<-p.encode
			t.Fatal("a prompt with a new picture never came to wait for the encoder")
		}
		return c, errs
	}
	quitter, quit := waiting()
	_, first := waiting()
	_, second := waiting()
	close(quitter.done)
	select {
	case err := <-quit:
		if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "wait to encode") {
			t.Fatalf("a prompt waiting to encode, its context cancelled: %v", err)
		}
	case <-time.After(time.Minute):
		<-p.encode
		t.Fatal("a prompt waiting to encode went on waiting once its context was cancelled")
	}
	before := p.encoded.Load()
	<-p.encode
	for _, errs := range []chan error{first, second} {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := p.encoded.Load() - before; n != 1 {
		t.Errorf("the same new picture in two prompts was encoded %d times, want once", n)
	}
}

// askedCtx is a context that says when a caller first asks for its Done
// channel (to wait on it), and ends only when done is closed.
type askedCtx struct {
	context.Context
	once        sync.Once
	asked, done chan struct{}
}

func (c *askedCtx) Done() <-chan struct{} {
	c.once.Do(func() { close(c.asked) })
	return c.done
}

func (c *askedCtx) Err() error {
	select {
	case <-c.done:
		return context.Canceled
	default:
		return nil
	}
}

// TestGemma3Images: Gemma 3's projector, whose image tokens attend to each
// other both ways. Each image is decoded in a pass of its own, attending both
// ways (the logits differ from a causal pass); the scheduler never cuts an
// image over steps; requests answer alike alone and together; an image
// larger than a step is refused.
func TestGemma3Images(t *testing.T) {
	spec := models.Gemma3Tiny()
	proj := filepath.Join(t.TempDir(), "gemma3-mmproj.gguf")
	if err := models.GenerateProjector(proj, spec, 64); err != nil {
		t.Fatal(err)
	}
	e := openTest(t, spec, func(c *Config) { c.Projector = proj })
	if c := e.Capacity(); !c.WholeMedia || c.PrefixReuse {
		t.Fatalf("capacity %+v: want WholeMedia (and Gemma 3's sliding window, so no prefix reuse)", c)
	}
	ctx := context.Background()
	prompts := picturePrompts(t, e.Projector(), func(i int) int { return i })
	for _, pr := range prompts {
		if len(pr.media) != 1 || pr.media[0].Len != 16 {
			t.Fatalf("media %+v: want one image of 16 tokens", pr.media)
		}
	}
	tol := max(4*kernelNoise(t, e), 1e-3)
	if err := e.ClearMemory(); err != nil {
		t.Fatal(err)
	}
	whole := lastLogits(t, e, prompts[0].toks, prompts[0].media, 0, 0, len(prompts[0].toks))
	// The same rows decoded causally (as for LLaVA's projector): other logits.
	e.cap.WholeMedia = false
	causal := lastLogits(t, e, prompts[0].toks, prompts[0].media, 1, 0, len(prompts[0].toks))
	e.cap.WholeMedia = true
	if d := maxAbsDiff(whole, causal); d < 10*tol {
		t.Errorf("decoded causally, the logits move by %.3g only: the image is not attending both ways", d)
	}

	req := func(pr imagePrompt) *scheduler.Request {
		r := &scheduler.Request{Prompt: pr.toks, Media: pr.media, MaxTokens: 10, IgnoreEOS: true}
		r.Sampling.TopLogprobs = 2 // the margins of ties
		return r
	}
	tie := max(0.02, tol)
	// Steps of 24 tokens: the text is cut, and the first step's would cut the
	// image (at 20..36) but for the scheduler, which computes it whole.
	if err := e.ClearMemory(); err != nil {
		t.Fatal(err)
	}
	if m := prompts[0].media[0]; m.Pos >= 24 || m.Pos+m.Len <= 24 {
		t.Fatalf("image at %d..%d: the test wants it across the first step's end", m.Pos, m.Pos+m.Len)
	}
	s := startSched(t, e, func(c *scheduler.Config) { c.MaxBatchTokens, c.MaxRunning = 24, 4 })
	alone := generateAll(t, s, prompts, req)
	var wg sync.WaitGroup
	together := make([]genResult, len(prompts))
	for i := range together {
		wg.Go(func() { together[i] = generate(ctx, s, req(prompts[i])) })
	}
	wg.Wait()
	for i, g := range together {
		if g.err != nil {
			t.Errorf("prompt %d together: %v", i, g.err)
		}
		sameGreedy(t, fmt.Sprintf("prompt %d together", i), g.tokens, alone[i].ref(), tie)
	}
	if slices.Equal(alone[0].tokens, alone[1].tokens) {
		t.Errorf("two pictures, one answer %v", alone[0].tokens)
	}
	// In steps of 24 the first token is the one the whole prompt decoded in
	// one batch gives.
	if got, want := alone[0].tokens[0], engine.Token(argmax(whole)); got != want && alone[0].margins[0] >= tie {
		t.Errorf("first token in steps of 24: %d, in one batch %d", got, want)
	}
	s2 := startSched(t, openTest(t, spec, func(c *Config) { c.Projector = proj }), func(c *scheduler.Config) { c.MaxBatchTokens, c.MaxRunning = 8, 4 })
	if _, err := s2.Submit(ctx, req(prompts[0])); err == nil {
		t.Error("an image of 16 tokens in steps of 8: want it refused")
	}
}
