package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"image"
	"image/color"
	"image/jpeg"
	"image/png"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/openai/openai-go/v3"

	"github.com/shoal-ai/shoal/api"
	"github.com/shoal-ai/shoal/models"
)

// visionModel writes a projector for smallModel and returns its path.
func visionProjector(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "mmproj.gguf")
	var out, errb strings.Builder
	if code := run([]string{"gen-model", "--preset", "small", "--mmproj", "--out", p}, &out, &errb); code != 0 {
		t.Fatalf("gen-model --mmproj: exit %d: %s", code, errb.String())
	}
	return p
}

// testImage encodes a w×h picture of colour c with a stripe, as PNG or JPEG.
func testImage(t *testing.T, w, h int, c color.RGBA, format string) []byte {
	t.Helper()
	im := image.NewRGBA(image.Rect(0, 0, w, h))
	for y := range h {
		for x := range w {
			im.Set(x, y, c)
			if x == y {
				im.Set(x, y, color.RGBA{255 - c.R, 255 - c.G, 255 - c.B, 255})
			}
		}
	}
	var buf bytes.Buffer
	var err error
	if format == "jpeg" {
		err = jpeg.Encode(&buf, im, &jpeg.Options{Quality: 95})
	} else {
		err = png.Encode(&buf, im)
	}
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func dataURL(format string, data []byte) string {
	return "data:image/" + format + ";base64," + base64.StdEncoding.EncodeToString(data)
}

// TestVisionNode: a node started with --mmproj answers chat requests with
// images through OpenAI's, Ollama's, Anthropic's and the Responses API's
// shapes, reads the picture (another answers otherwise), caches a prompt
// through its image, answers concurrent requests as it answers each alone,
// and refuses what it cannot read with OpenAI's errors.
func TestVisionNode(t *testing.T) {
	proj := visionProjector(t)
	n := startNode(t, "--model", smallModel(t), "--model-name", "v", "--mmproj", proj, "--max-model-len", "256")
	defer func() {
		if !strings.Contains(n.log(), "projector loaded") || !strings.Contains(n.log(), " images=1 encode_ms=") {
			t.Errorf("the log has no projector line or no request line counting images")
		}
	}()
	c := n.client("")
	ctx := context.Background()
	colours := []color.RGBA{{220, 20, 20, 255}, {20, 20, 220, 255}, {20, 200, 40, 255}, {240, 240, 0, 255}}
	pics := make([]string, len(colours))
	for i, col := range colours {
		format := []string{"png", "jpeg"}[i%2]
		pics[i] = dataURL(format, testImage(t, 24+8*i, 40-4*i, col, format))
	}
	ask := func(pic string) (string, int64, error) {
		r, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model: "v", MaxTokens: openai.Int(8), Temperature: openai.Float(0),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
				openai.TextContentPart("What is in this picture?"),
				openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: pic}),
			})},
		})
		if err != nil {
			return "", 0, err
		}
		return r.Choices[0].Message.Content, r.Usage.PromptTokensDetails.CachedTokens, nil
	}
	alone := make([]string, len(pics))
	for i, pic := range pics {
		text, _, err := ask(pic)
		if err != nil {
			t.Fatal(err)
		}
		alone[i] = text
	}
	if alone[0] == alone[1] || alone[1] == alone[2] {
		t.Errorf("pictures read alike: %q", alone)
	}
	again, cached, err := ask(pics[0])
	side := models.ProjectorImageSize / models.ProjectorPatchSize
	if err != nil || again != alone[0] || cached < int64(side*side) {
		t.Errorf("again: %q with %d cached (%v), want %q with the prefix through the image cached", again, cached, err, alone[0])
	}

	// Concurrent requests, each picture twice, answer as alone.
	var wg sync.WaitGroup
	got := make([]string, 2*len(pics))
	errs := make([]error, len(got))
	for i := range got {
		wg.Go(func() { got[i], _, errs[i] = ask(pics[i%len(pics)]) })
	}
	wg.Wait()
	for i := range got {
		if errs[i] != nil || got[i] != alone[i%len(pics)] {
			t.Errorf("concurrent %d: %q (%v), alone %q", i, got[i], errs[i], alone[i%len(pics)])
		}
	}

	// Streamed.
	st := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model: "v", MaxTokens: openai.Int(8), Temperature: openai.Float(0),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
			openai.TextContentPart("What is in this picture?"),
			openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: pics[1]}),
		})},
	})
	var streamed strings.Builder
	for st.Next() {
		if ch := st.Current().Choices; len(ch) > 0 {
			streamed.WriteString(ch[0].Delta.Content)
		}
	}
	if st.Err() != nil || streamed.String() != alone[1] {
		t.Errorf("streamed: %q (%v), want %q", streamed.String(), st.Err(), alone[1])
	}

	// Ollama's, Anthropic's and the Responses API's shapes.
	raw := func(pic string) string { return strings.SplitN(pic, ",", 2)[1] }
	for _, cs := range []struct{ path, body string }{
		{"/api/chat", fmt.Sprintf(`{"model":"v","stream":false,"options":{"num_predict":4},"messages":[{"role":"user","content":"what is it","images":[%q]}]}`, raw(pics[0]))},
		{"/api/generate", fmt.Sprintf(`{"model":"v","stream":false,"options":{"num_predict":4},"prompt":"what is it","images":[%q]}`, raw(pics[1]))},
		{"/v1/messages", fmt.Sprintf(`{"model":"v","max_tokens":4,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":%q}},{"type":"text","text":"what is it"}]}]}`, raw(pics[2]))},
		{"/v1/responses", fmt.Sprintf(`{"model":"v","max_output_tokens":4,"input":[{"role":"user","content":[{"type":"input_text","text":"what is it"},{"type":"input_image","image_url":%q}]}]}`, pics[3])},
	} {
		if resp, out := post(t, n.url+cs.path, cs.body); resp.StatusCode != 200 {
			t.Errorf("%s: %d %s", cs.path, resp.StatusCode, out)
		}
	}
	if resp, out := post(t, n.url+"/api/show", `{"model":"v"}`); resp.StatusCode != 200 || !strings.Contains(out, `"vision"`) {
		t.Errorf("/api/show: %d %s, want the vision capability", resp.StatusCode, out)
	}
	if resp, out := post(t, n.url+"/apply-template", fmt.Sprintf(`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":%q}}]}]}`, pics[0])); resp.StatusCode != 200 || !strings.Contains(out, `__media__`) || strings.Contains(out, "base64") {
		t.Errorf("/apply-template: %d %s, want llama.cpp's marker for the image", resp.StatusCode, out)
	}

	// Refusals, in OpenAI's error format.
	chat := func(parts string) string {
		return `{"model":"v","max_tokens":4,"messages":[{"role":"user","content":[` + parts + `]}]}`
	}
	img := func(url string) string { return fmt.Sprintf(`{"type":"image_url","image_url":{"url":%q}}`, url) }
	for name, cs := range map[string]struct{ body, want string }{
		"web URL":       {chat(img("https://example.com/cat.png")), "data: URL"},
		"bad base64":    {chat(img("data:image/png;base64,@@@")), "base64"},
		"not an image":  {chat(img(dataURL("png", []byte("hello")))), "not an image"},
		"unknown part":  {chat(`{"type":"input_audio","input_audio":{}}`), "image_url"},
		"too long":      {chat(strings.Repeat(img(pics[0])+",", 15) + img(pics[1])), "maximum context length"},
		"tokenize":      {`{"model":"v","messages":[{"role":"user","content":[` + img(pics[0]) + `]}]}`, "not tokenized"},
		"prompt scored": {`{"model":"v","max_tokens":1,"prompt_logprobs":1,"messages":[{"role":"user","content":[` + img(pics[0]) + `]}]}`, "scored"},
	} {
		path := "/v1/chat/completions"
		if name == "tokenize" {
			path = "/tokenize"
		}
		resp, out := post(t, n.url+path, cs.body)
		var e api.ErrorBody
		if resp.StatusCode != 400 || json.Unmarshal([]byte(out), &e) != nil || !strings.Contains(e.Error.Message, cs.want) {
			t.Errorf("%s: %d %s, want 400 saying %q", name, resp.StatusCode, out, cs.want)
		}
	}
	// Still answering as before.
	if text, _, err := ask(pics[2]); err != nil || text != alone[2] {
		t.Errorf("after the refusals: %q (%v), want %q", text, err, alone[2])
	}

	// A node without a projector says so.
	plain := startNode(t, "--model", smallModel(t), "--model-name", "v")
	if resp, out := post(t, plain.url+"/v1/chat/completions", chat(img(pics[0]))); resp.StatusCode != 400 || !strings.Contains(out, "--mmproj") {
		t.Errorf("no projector: %d %s", resp.StatusCode, out)
	}
}

// TestVisionInCluster: of two nodes serving one model, one with a projector,
// requests with images sent to either are computed by the one that reads
// them; requests without images go to either; /cluster says which reads
// images.
func TestVisionInCluster(t *testing.T) {
	proj := visionProjector(t)
	gk := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	eyes := startNode(t, "--model", smallModel(t), "--model-name", "v", "--mmproj", proj, "--node-name", "eyes", "--gossip-addr", g1, "--gossip-key", gk)
	blind := startNode(t, "--model", smallModel(t), "--model-name", "v", "--node-name", "blind", "--gossip-addr", freeAddr(t), "--join", g1, "--gossip-key", gk)
	waitFor(t, "blind sees eyes read images", func() bool {
		for _, m := range clusterMembers(t, blind) {
			if m.Name == "eyes" && m.Vision && m.State == "alive" {
				return true
			}
		}
		return false
	})
	pic := dataURL("png", testImage(t, 20, 20, color.RGBA{200, 10, 10, 255}, "png"))
	body := fmt.Sprintf(`{"model":"v","max_tokens":4,"temperature":0,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":%q}},{"type":"text","text":"what is it"}]}]}`, pic)
	_, direct := post(t, eyes.url+"/v1/chat/completions", body)
	for i := range 4 {
		resp, out := post(t, blind.url+"/v1/chat/completions", body)
		if resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "eyes" {
			t.Fatalf("image request %d to blind: %d served by %q: %s", i, resp.StatusCode, resp.Header.Get("X-Shoal-Served-By"), out)
		}
		var a, b struct {
			Choices []struct{ Message struct{ Content string } }
		}
		if json.Unmarshal([]byte(out), &a) != nil || json.Unmarshal([]byte(direct), &b) != nil || len(a.Choices) != 1 || a.Choices[0] != b.Choices[0] {
			t.Fatalf("forwarded %s, direct %s", out, direct)
		}
	}
	// Text requests may go to either node: blind answers some itself.
	self := 0
	for i := range 8 {
		resp, out := post(t, eyes.url+"/v1/chat/completions", fmt.Sprintf(`{"model":"v","max_tokens":2,"messages":[{"role":"user","content":"question %d, a different one each time"}]}`, i))
		if resp.StatusCode != 200 {
			t.Fatalf("text request: %d %s", resp.StatusCode, out)
		}
		if resp.Header.Get("X-Shoal-Served-By") == "blind" {
			self++
		}
	}
	if self == 0 {
		t.Errorf("no text request of 8 went to the node without a projector")
	}
}
