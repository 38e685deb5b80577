package llama

import (
	"context"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

// mropeRows adds rows [from, to) of a prompt with M-RoPE media to b for
// sequence s, placed as llama.cpp places them: an image's rows share its
// first position, each at its line and column, and the image spans the
// longer side of its grid.
func mropeRows(b *engine.Batch, toks []engine.Token, media []engine.Media, s engine.SeqID, from, to int) {
	for p := from; p < to; p++ {
		shift, at := 0, -1
		var y, x int
		for _, m := range media {
			if p < m.Pos {
				break
			}
			if i := p - m.Pos; i < m.Len {
				at, y, x = m.Pos-shift, i/m.Cols, i%m.Cols
				b.AddEmbdAt(toks[p], m.Row(p), engine.Pos(at), engine.Pos(y), engine.Pos(x), s, false)
				break
			}
			shift += m.Len - m.Positions()
		}
		if at < 0 {
			b.Add(toks[p], engine.Pos(p-shift), s, p == len(toks)-1)
		}
	}
}

// qwenPictures are two pictures whose grids are not square, one wide and
// one tall.
var qwenPictures = []engine.Image{
	picture(96, 48, [3]byte{200, 30, 30}, [3]byte{0, 0, 0}),
	picture(32, 80, [3]byte{20, 40, 220}, [3]byte{255, 255, 255}),
}

func maxDiff(a, b []float32) float64 {
	d := 0.0
	for i := range a {
		d = max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// TestQwenVLImages: a Qwen2-VL or Qwen2.5-VL projector's images are grids
// placed by M-RoPE, and the engine computes a prompt with them as llama.cpp's own
// helper does (mtmd_helper_eval_chunks), whole, in chunks that end at an
// image's edges, and beside other sequences; placed as plain indices they
// would give other logits.
func TestQwenVLImages(t *testing.T) {
	for _, spec := range []models.Spec{models.QwenVLTiny(), models.QwenVL25Tiny(), models.QwenVL3Tiny()} {
		t.Run(spec.Name, func(t *testing.T) { qwenVLImages(t, spec) })
	}
}

func qwenVLImages(t *testing.T, spec models.Spec) {
	e := openWithProjector(t, spec)
	p := e.Projector()
	ctx := context.Background()
	if c := e.Capacity(); !c.MRoPE || c.WholeMedia {
		t.Fatalf("capacity %+v: want M-RoPE", c)
	}
	text := "USER: " + p.Marker() + " and " + p.Marker() + "\nWhat differs between them? ASSISTANT:"
	toks, media, err := p.Prompt(ctx, text, qwenPictures, 0, true, false)
	if err != nil {
		t.Fatal(err)
	}
	// 16 pixels a token, scaled up to at least 8 tokens.
	if len(media) != 2 || media[0].Cols != 6 || media[0].Rows != 3 || media[1].Cols != 2 || media[1].Rows != 5 ||
		media[0].Positions() != 6 || media[1].Positions() != 5 {
		t.Fatalf("media grids %+v %+v: want 6×3 and 2×5", media[0], media[1])
	}
	if l, err := p.Layout(text, qwenPictures, true, false); err != nil || !slices.Equal(l, toks) {
		t.Errorf("Layout: %v (%v), Prompt made %v", l, err, toks)
	}
	ref, next, err := p.reference(e, text, qwenPictures, 0)
	if err != nil {
		t.Fatal(err)
	}
	if want := len(toks) - (18 - 6) - (10 - 5); int(next) != want {
		t.Fatalf("llama.cpp's helper ends at position %d, want %d (%d tokens, images over fewer positions)", next, want, len(toks))
	}
	decode := func(s engine.SeqID, cuts ...int) []float32 {
		t.Helper()
		var out []float32
		from := 0
		for _, to := range append(cuts, len(toks)) {
			var b engine.Batch
			mropeRows(&b, toks, media, s, from, to)
			if to == len(toks) {
				out = decodeLast(t, e, &b)
			} else if err := e.Decode(ctx, &b); err != nil {
				t.Fatalf("decode rows %d..%d: %v", from, to, err)
			}
			from = to
		}
		return out
	}
	whole := decode(1)
	if d := maxDiff(whole, ref); d > 1e-3 {
		t.Errorf("whole prompt: logits differ from llama.cpp's helper's by %g", d)
	}
	m0, m1 := media[0], media[1]
	if d := maxDiff(decode(2, 3, m0.Pos, m0.Pos+m0.Len, m1.Pos, m1.Pos+m1.Len+2), ref); d > 1e-3 {
		t.Errorf("in chunks ending at the images' edges: logits differ by %g", d)
	}
	// Beside two other sequences, one with the same prompt from an earlier
	// point, in one Decode.
	var b engine.Batch
	mropeRows(&b, toks, media, 3, 0, len(toks))
	other := tokenize(t, e, "Another sequence, with text only, decoded beside.")
	for i, tk := range other {
		b.Add(tk, engine.Pos(i), 4, false)
	}
	if err := e.Decode(ctx, &b); err != nil {
		t.Fatal(err)
	}
	var beside []float32
	if err := e.Logits(len(toks)-1, func(l []float32) { beside = slices.Clone(l) }); err != nil {
		t.Fatal(err)
	}
	if d := maxDiff(beside, ref); d > 1e-3 {
		t.Errorf("beside another sequence: logits differ by %g", d)
	}
	// Placed by index, as a model without M-RoPE places images: not the
	// same computation (so the comparisons above compare something).
	b.Reset()
	promptRows(&b, toks, media, 5, 0, len(toks))
	if d := maxDiff(decodeLast(t, e, &b), ref); d < 1e-2 {
		t.Errorf("images placed by index: logits differ by only %g from M-RoPE's", d)
	}
	// An image row placed before what its sequence holds is refused, and
	// the sequence keeps its cells.
	b.Reset()
	b.AddEmbdAt(toks[m0.Pos], m0.Row(m0.Pos), 0, 0, 0, 1, false)
	if err := e.Decode(ctx, &b); !errors.Is(err, engine.ErrInvalidInput) {
		t.Errorf("an image row placed at 0 after the prompt: %v, want refused", err)
	}
	if _, hi, ok := e.SeqPosRange(1); !ok || hi != next-1 {
		t.Errorf("sequence 1 holds up to %d (%v), want %d", hi, ok, next-1)
	}

	// A picture of several attention windows of Qwen2.5-VL's encoder (7×7
	// tokens each): 10×8 tokens.
	big := []engine.Image{picture(160, 128, [3]byte{90, 160, 30}, [3]byte{10, 10, 10})}
	text2 := "USER: " + p.Marker() + " Describe it. ASSISTANT:"
	ref2, _, err := p.reference(e, text2, big, 6)
	if err != nil {
		t.Fatal(err)
	}
	toks2, media2, err := p.Prompt(ctx, text2, big, 0, true, false)
	if err != nil || len(media2) != 1 || media2[0].Cols != 10 || media2[0].Rows != 8 {
		t.Fatalf("a 160×128 picture: %+v (%v), want a grid of 10×8", media2, err)
	}
	b.Reset()
	mropeRows(&b, toks2, media2, 7, 0, len(toks2))
	if d := maxDiff(decodeLast(t, e, &b), ref2); d > 1e-3 {
		t.Errorf("a picture of several windows: logits differ from llama.cpp's helper's by %g", d)
	}

	// A projector placing images by M-RoPE for a model that does not (of
	// the same width), and the other way round: refused at start.
	qwenProj := filepath.Join(t.TempDir(), "qwen-mmproj.gguf")
	llavaProj := filepath.Join(t.TempDir(), "llava-mmproj.gguf")
	if err := models.GenerateProjector(qwenProj, models.QwenVLTiny(), 0); err != nil {
		t.Fatal(err)
	}
	if err := models.GenerateProjector(llavaProj, models.Tiny(), 0); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ model, proj string }{{genModel(t, models.Tiny()), qwenProj}, {genModel(t, models.QwenVLTiny()), llavaProj}} {
		cfg := DefaultConfig(c.model)
		cfg.ContextCells, cfg.MaxSeqs, cfg.Threads, cfg.Projector = 1024, 4, 2, c.proj
		if e, err := Open(cfg); err == nil || !strings.Contains(err.Error(), "M-RoPE") {
			if e != nil {
				e.Close()
			}
			t.Errorf("%s with %s: %v, want refused for M-RoPE", filepath.Base(c.model), filepath.Base(c.proj), err)
		}
	}
}

// TestSchedulerQwenVL: the scheduler places a Qwen2-VL prompt's images by
// M-RoPE: its answer is the one llama.cpp's helper computes, requests
// answer alike alone, together (with choices forked from one prompt and
// proposals, whose rejected rows are cut back after an image), in steps that
// cut images, and repeated (their images from the cache, whole).
func TestSchedulerQwenVL(t *testing.T) {
	for _, spec := range []models.Spec{models.QwenVLTiny(), models.QwenVL3Tiny()} {
		t.Run(spec.Name, func(t *testing.T) { schedulerQwenVL(t, spec) })
	}
}

func schedulerQwenVL(t *testing.T, spec models.Spec) {
	open := func(t *testing.T) *Engine { return openWithProjector(t, spec) }
	e := open(t)
	p := e.Projector()
	ctx := context.Background()
	type prompt struct {
		text   string
		images []engine.Image
		toks   []engine.Token
		media  []engine.Media
	}
	var prompts []prompt
	for _, images := range [][]engine.Image{qwenPictures[:1], qwenPictures[1:], qwenPictures} {
		text := "USER: Look. "
		for range images {
			text += p.Marker() + " "
		}
		text += "Describe it. ASSISTANT:"
		toks, media, err := p.Prompt(ctx, text, images, 0, true, false)
		if err != nil {
			t.Fatal(err)
		}
		prompts = append(prompts, prompt{text, images, toks, media})
	}
	req := func(pr prompt) *scheduler.Request {
		r := &scheduler.Request{Prompt: pr.toks, Media: pr.media, MaxTokens: 10, IgnoreEOS: true}
		r.Sampling.Logprobs, r.Sampling.TopLogprobs = true, 2 // and the margins of ties
		return r
	}
	// Greedy tokens as llama.cpp's helper computes the prompt, then one
	// token at a time.
	ref, next, err := p.reference(e, prompts[2].text, prompts[2].images, 9)
	if err != nil {
		t.Fatal(err)
	}
	var greedy []engine.Token
	var logprobs []float64
	for k := range 10 {
		tok := engine.Token(slices.Index(ref, slices.Max(ref)))
		greedy = append(greedy, tok)
		sum := 0.0
		for _, l := range ref {
			sum += math.Exp(float64(l - ref[tok]))
		}
		logprobs = append(logprobs, -math.Log(sum))
		var b engine.Batch
		b.Add(tok, next+engine.Pos(k), 9, true)
		if err := e.Decode(ctx, &b); err != nil {
			t.Fatal(err)
		}
		if err := e.Logits(0, func(l []float32) { ref = slices.Clone(l) }); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.SeqRemove(9, 0, -1); err != nil {
		t.Fatal(err)
	}
	tie := tieMargin(t, e)
	s := startSched(t, e, func(c *scheduler.Config) { c.MaxBatchTokens, c.MaxRunning = 24, 4 })
	alone := generateAll(t, s, prompts, req)
	// The answer's log-probabilities too: greedy choices alone hardly move.
	toks, lps, err := choices(ctx, s, req(prompts[2]))
	if err != nil || !slices.Equal(toks[0], greedy) {
		t.Fatalf("two pictures: %v %v, as llama.cpp's helper lays the prompt out: %v", err, toks[0], greedy)
	}
	for k, lp := range lps[0] {
		if math.Abs(float64(lp)-logprobs[k]) > 1e-3 {
			t.Errorf("token %d: log-probability %g, as llama.cpp's helper lays the prompt out %g", k, lp, logprobs[k])
		}
	}
	if slices.Equal(alone[0].tokens, alone[1].tokens) {
		t.Errorf("two pictures, one answer %v: the image is not read", alone[0].tokens)
	}
	again := generate(ctx, s, req(prompts[0]))
	if m := prompts[0].media[0]; again.err != nil || again.cached < m.Pos+m.Len {
		t.Errorf("again: %v with %d cached, want the prefix through the image (%d) cached", again.err, again.cached, m.Pos+m.Len)
	}
	sameGreedy(t, "again", again.tokens, alone[0].ref(), tie)

	e2 := open(t)
	s2 := startSched(t, e2, func(c *scheduler.Config) { c.MaxRunning, c.Spec.Tokens = 8, 3 })
	var wg sync.WaitGroup
	together := make([][][]engine.Token, 2*len(prompts))
	errs := make([]error, len(together))
	for i := range together {
		wg.Go(func() {
			r := req(prompts[i%len(prompts)])
			if i >= len(prompts) {
				r.N = 2 // choices forked from one computed prompt
			}
			together[i], _, errs[i] = choices(ctx, s2, r)
		})
	}
	wg.Wait()
	for i, cs := range together {
		if errs[i] != nil {
			t.Errorf("request %d together: %v", i, errs[i])
		}
		for k, got := range cs {
			sameGreedy(t, fmt.Sprintf("request %d together, choice %d", i, k), got, alone[i%len(prompts)].ref(), tie)
		}
	}
	// In steps of 5 tokens, which cut every image.
	s3 := startSched(t, open(t), func(c *scheduler.Config) { c.MaxBatchTokens, c.MaxRunning = 5, 4 })
	for i, pr := range prompts {
		g := generate(ctx, s3, req(pr))
		if g.err != nil {
			t.Errorf("prompt %d in steps of 5: %v", i, g.err)
		}
		sameGreedy(t, fmt.Sprintf("prompt %d in steps of 5", i), g.tokens, alone[i].ref(), tie)
	}
}

// choices runs r and returns each choice's tokens and their
// log-probabilities (when r asks for them).
func choices(ctx context.Context, s *scheduler.Scheduler, r *scheduler.Request) ([][]engine.Token, [][]float32, error) {
	st, err := s.Submit(ctx, r)
	if err != nil {
		return nil, nil, err
	}
	toks, lps := make([][]engine.Token, max(r.N, 1)), make([][]float32, max(r.N, 1))
	for {
		ev, ok := st.Next(ctx)
		if !ok {
			return toks, lps, nil
		}
		switch ev.Kind {
		case scheduler.EventToken:
			toks[ev.Index] = append(toks[ev.Index], ev.Token)
			lps[ev.Index] = append(lps[ev.Index], ev.Logprob)
		case scheduler.EventError:
			return toks, lps, ev.Err
		}
	}
}
