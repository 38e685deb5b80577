package llama

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/models"
	"github.com/shoal-ai/shoal/scheduler"
)

// BenchmarkSchedulerImages: chats about pictures, a user asking follow-up
// questions about one image turn after turn, several users at once: the 100M
// model with a projector that makes an image LLaVA 1.5's 576 tokens. With
// the prefix cache a turn computes only what follows the last turn's cached
// blocks; without it, the image and the whole history again. The same model
// as Qwen2-VL's architecture, its projector making each picture a 24×24 grid
// (576 tokens) placed by M-RoPE, whose cells share one position: cached too,
// an image's blocks taken, kept and dropped together. (The projectors'
// encoders are tiny: their own cost is not what is measured.)
//
// workload=questions: each turn a new prompt, the same picture and another
// question about it right after it, not the history: the cached prefix ends
// within the picture's last block, and takes the rest of the picture too
// (for Qwen2-VL's uncut images: not only the blocks before it).
func BenchmarkSchedulerImages(b *testing.B) {
	const users, turns, answer = 4, 4, 16
	questions := []string{"Which colours are in it?", "How many shapes are there?", "Where is the yellow part?", "Is it a photograph?"}
	for _, c := range []struct {
		layout  string
		caching bool
	}{{"llava", false}, {"llava", true}, {"qwen2vl", true}} {
		spec, side := models.Bench100M(), 192
		if c.layout == "qwen2vl" {
			spec.Name, spec.QwenVL, side = spec.Name+"-qwen2vl", true, 0
		}
		path := genModel(b, spec)
		proj := filepath.Join(b.TempDir(), "mmproj-576.gguf")
		if err := models.GenerateProjector(proj, spec, side); err != nil {
			b.Fatal(err)
		}
		e := openFile(b, path, func(cfg *Config) {
			cfg.Projector, cfg.ContextCells, cfg.MaxSeqs, cfg.BatchTokens = proj, 8192, 16, 2048
		})
		p := e.Projector()
		ctx := context.Background()
		pics := make([]engine.Image, users)
		for u := range pics {
			pics[u] = picture(320+u, 240, [3]byte{byte(60 * u), 90, 200}, [3]byte{255, 255, 0})
			if c.layout == "qwen2vl" {
				pics[u] = picture(384+u, 384, [3]byte{byte(60 * u), 90, 200}, [3]byte{255, 255, 0}) // 24×24 tokens
			}
		}
		caching := c.caching
		for _, workload := range []string{"chat", "questions"} {
			b.Run(fmt.Sprintf("model=100m/layout=%s/image=576/caching=%v/workload=%s", c.layout, caching, workload), func(b *testing.B) {
				var ttft []time.Duration // of the turns after the first
				var wall time.Duration
				var cached, prompt int
				var mu sync.Mutex
				for b.Loop() {
					if err := e.ClearMemory(); err != nil {
						b.Fatal(err)
					}
					s := startSched(b, e, func(c *scheduler.Config) {
						c.MaxRunning, c.MaxBatchTokens, c.KV.Caching = users, 512, caching
					})
					start := time.Now()
					var wg sync.WaitGroup
					for u := range users {
						wg.Go(func() {
							history := "USER: " + p.Marker() + "\nWhat is in this picture? ASSISTANT:"
							for turn := range turns {
								toks, media, err := p.Prompt(ctx, history, pics[u:u+1], 0, true, false)
								if err != nil {
									b.Error(err)
									return
								}
								if media[0].Len != 576 {
									b.Errorf("an image of %d tokens, want 576", media[0].Len)
									return
								}
								asked := time.Now()
								g := generate(ctx, s, &scheduler.Request{Prompt: toks, Media: media, MaxTokens: answer, IgnoreEOS: true})
								if g.err != nil {
									b.Error(g.err)
									return
								}
								mu.Lock()
								if turn > 0 {
									ttft = append(ttft, g.first.Sub(asked))
								}
								cached, prompt = cached+g.cached, prompt+len(toks)
								mu.Unlock()
								if workload == "chat" {
									history += g.text + fmt.Sprintf("\nUSER: And what about part %d of it? ASSISTANT:", turn)
								} else {
									// Other words right after the picture, within its last block.
									history = "USER: " + p.Marker() + questions[turn%len(questions)] + " ASSISTANT:"
								}
							}
						})
					}
					wg.Wait()
					wall += time.Since(start)
				}
				if len(ttft) == 0 {
					return
				}
				slices.Sort(ttft)
				b.ReportMetric(wall.Seconds()/float64(b.N), "s/run")
				b.ReportMetric(float64(ttft[len(ttft)/2].Milliseconds()), "ms-follow-up-ttft-p50")
				b.ReportMetric(float64(cached)/float64(prompt), "cached/prompt")
			})
		}
	}
}
