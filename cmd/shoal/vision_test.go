package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"image"
	"image/color"
	"image/jpeg"
	"image/png"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"

	"github.com/shoal-ai/shoal/api"
	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/models"
)

// visionProjector writes a projector for smallModel and returns its path.
func visionProjector(t *testing.T) string {
	return genFile(t, "mmproj.gguf", "--preset", "small", "--mmproj")
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
		if v := n.metric(t, "shoal_images_total"); v == "" || v == "0" {
			t.Errorf("shoal_images_total %q after image requests", v)
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

	// Two choices of one request, forked after the prompt with its image.
	two, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: "v", MaxTokens: openai.Int(8), Temperature: openai.Float(0), N: openai.Int(2),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
			openai.TextContentPart("What is in this picture?"),
			openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: pics[3]}),
		})},
	})
	if err != nil || len(two.Choices) != 2 || two.Choices[0].Message.Content != alone[3] || two.Choices[1].Message.Content != alone[3] {
		t.Errorf("n=2: %v %+v, want %q twice", err, two, alone[3])
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

// TestVisionInCluster: of three nodes serving one model, two with a
// projector, requests with images sent to any are computed by one that reads
// them, and a chat's later turn goes where its picture is cached; requests
// without images go to any node; /cluster says which read images; with no
// node reading images left, the request is refused for now (503), not for
// good.
func TestVisionInCluster(t *testing.T) {
	proj := visionProjector(t)
	gk := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g1 := freeAddr(t)
	const secret = "vision-test-secret"
	common := []string{"--model", smallModel(t), "--model-name", "v", "--gossip-key", gk, "--cluster-secret", secret}
	eyes := startNode(t, append(common, "--mmproj", proj, "--node-name", "eyes", "--gossip-addr", g1)...)
	eyes2 := startNode(t, append(common, "--mmproj", proj, "--node-name", "eyes2", "--gossip-addr", freeAddr(t), "--join", g1)...)
	blind := startNode(t, append(common, "--node-name", "blind", "--gossip-addr", freeAddr(t), "--join", g1)...)
	waitFor(t, "blind sees both nodes read images", func() bool {
		n := 0
		for _, m := range clusterMembers(t, blind) {
			if m.Vision && m.State == "alive" {
				n++
			}
		}
		return n == 2
	})
	pic := dataURL("png", testImage(t, 20, 20, color.RGBA{200, 10, 10, 255}, "png"))
	chat := func(text string) string {
		return fmt.Sprintf(`{"model":"v","max_tokens":4,"temperature":0,"messages":[{"role":"user","content":[{"type":"text","text":%q},{"type":"image_url","image_url":{"url":%q}},{"type":"text","text":"what is it"}]}]}`, text, pic)
	}
	answer := func(out string) string {
		var a struct {
			Choices []struct{ Message struct{ Content string } }
		}
		if json.Unmarshal([]byte(out), &a) != nil || len(a.Choices) != 1 {
			t.Fatalf("answer: %s", out)
		}
		return a.Choices[0].Message.Content
	}
	_, direct := post(t, eyes.url+"/v1/chat/completions", chat("look"))
	for i := range 4 {
		resp, out := post(t, blind.url+"/v1/chat/completions", chat("look"))
		if by := resp.Header.Get("X-Shoal-Served-By"); resp.StatusCode != 200 || by != "eyes" && by != "eyes2" {
			t.Fatalf("image request %d to blind: %d served by %q: %s", i, resp.StatusCode, by, out)
		}
		if answer(out) != answer(direct) {
			t.Fatalf("forwarded %s, direct %s", out, direct)
		}
	}
	ollama := fmt.Sprintf(`{"model":"v","stream":false,"options":{"num_predict":2},"messages":[{"role":"user","content":"what is it","images":[%q]}]}`, strings.SplitN(pic, ",", 2)[1])
	if resp, out := post(t, blind.url+"/api/chat", ollama); resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("X-Shoal-Served-By"), "eyes") {
		t.Fatalf("Ollama's chat with an image to blind: %d served by %q: %s", resp.StatusCode, resp.Header.Get("X-Shoal-Served-By"), out)
	}
	// Beyond blind's own 8 MiB (a phone's photo in base64, here padding
	// JSON allows): taken, as its cluster reads images.
	if resp, out := post(t, blind.url+"/v1/chat/completions", chat("look")+strings.Repeat(" ", 9<<20)); resp.StatusCode != 200 || answer(out) != answer(direct) {
		t.Fatalf("a 9 MiB image request to blind: %d served by %q: %.300s", resp.StatusCode, resp.Header.Get("X-Shoal-Served-By"), out)
	}

	// A long chat about a picture, computed on eyes2 (sent as a peer's hop,
	// so that eyes2 computes it): sent to eyes, it goes where its prefix
	// through the picture is cached, once eyes has heard what eyes2 caches:
	// nodes reading images route by the prompt with its images laid out. (By
	// the text around the picture, which shares no block with it, eyes would
	// compute it itself: it comes first among equals.)
	// The picture first: the text around it alone shares no block with what
	// the nodes cache.
	long := fmt.Sprintf(`{"model":"v","max_tokens":4,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":%q}},{"type":"text","text":%q}]}]}`,
		pic, strings.Repeat("Here is a long description of what I want to know about the picture. ", 12))
	resp, out := postHop(t, eyes2.url+"/v1/chat/completions", long, secret)
	if resp.StatusCode != 200 || resp.Header.Get("X-Shoal-Served-By") != "" {
		t.Fatalf("warm eyes2: %d served by %q: %s", resp.StatusCode, resp.Header.Get("X-Shoal-Served-By"), out)
	}
	warm, other := "eyes2", eyes
	waitFor(t, "eyes hears of eyes2's cached blocks", func() bool {
		for _, m := range clusterMembers(t, other) {
			if m.Name == warm && m.SummaryBlocks >= 12 {
				return true
			}
		}
		return false
	})
	// Three times: a request that matched nothing would go by turns (and,
	// once computed on the other, stay there).
	for range 3 {
		resp, out = post(t, other.url+"/v1/chat/completions", long)
		var u struct {
			Usage struct {
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		json.Unmarshal([]byte(out), &u)
		side := models.ProjectorImageSize / models.ProjectorPatchSize
		if resp.Header.Get("X-Shoal-Served-By") != warm || u.Usage.PromptTokensDetails.CachedTokens < 100+side*side {
			t.Fatalf("the chat sent again: served by %q with %d tokens cached, want %s, its prefix through the picture cached: %s",
				resp.Header.Get("X-Shoal-Served-By"), u.Usage.PromptTokensDetails.CachedTokens, warm, out)
		}
	}

	// Text requests may go to any node: blind answers some itself.
	self := 0
	for i := range 12 {
		resp, out := post(t, eyes.url+"/v1/chat/completions", fmt.Sprintf(`{"model":"v","max_tokens":2,"messages":[{"role":"user","content":"question %d, a different one each time"}]}`, i))
		if resp.StatusCode != 200 {
			t.Fatalf("text request: %d %s", resp.StatusCode, out)
		}
		if resp.Header.Get("X-Shoal-Served-By") == "blind" {
			self++
		}
	}
	if self == 0 {
		t.Errorf("no text request of 12 went to the node without a projector")
	}

	// The nodes reading images gone: refused for now.
	for _, n := range []*node{eyes, eyes2} {
		n.cmd.Process.Kill()
		<-n.done
	}
	resp, out = post(t, blind.url+"/v1/chat/completions", chat("look"))
	if resp.StatusCode != 503 || !strings.Contains(out, "no_vision_node") || resp.Header.Get("Retry-After") == "" {
		t.Errorf("no node reading images: %d %s, want 503 no_vision_node with Retry-After", resp.StatusCode, out)
	}
}

// postHop posts body to url as a peer's forward, signed with the cluster's
// secret, so that the node computes it itself.
func postHop(t *testing.T, url, body, secret string) (*http.Response, string) {
	t.Helper()
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	path := url[strings.Index(url[len("http://"):], "/")+len("http://"):]
	bh := sha256.Sum256([]byte(body))
	m := hmac.New(sha256.New, []byte(secret))
	fmt.Fprintf(m, "%s\n%s\n%s\n%s\n%x", "test", ts, "POST", path, bh)
	return post(t, url, body, cluster.HeaderHop, "1", cluster.HeaderFrom, "test", cluster.HeaderTime, ts, cluster.HeaderAuth, hex.EncodeToString(m.Sum(nil)))
}

// TestGemma3VisionNode: a Gemma 3 model with its projector (image tokens
// attending both ways) reads pictures through the API.
func TestGemma3VisionNode(t *testing.T) {
	model := genFile(t, "g.gguf", "--preset", "gemma3-tiny")
	proj := genFile(t, "g-mmproj.gguf", "--preset", "gemma3-tiny", "--mmproj", "--image-size", "64")
	n := startNode(t, "--model", model, "--model-name", "g", "--mmproj", proj, "--max-batch-tokens", "64")
	c := n.client("")
	ask := func(pic string) string {
		r, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
			Model: "g", MaxTokens: openai.Int(6), Temperature: openai.Float(0),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
				openai.TextContentPart("What is this?"),
				openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: pic}),
			})},
		})
		if err != nil {
			t.Fatal(err)
		}
		return r.Choices[0].Message.Content
	}
	red := dataURL("png", testImage(t, 30, 30, color.RGBA{220, 20, 20, 255}, "png"))
	blue := dataURL("png", testImage(t, 30, 30, color.RGBA{20, 20, 220, 255}, "png"))
	a, b := ask(red), ask(blue)
	if a == b || ask(red) != a {
		t.Errorf("answers %q, %q, then %q: want the pictures read apart, the same picture alike", a, b, ask(red))
	}
}

// TestVisionClusterWithoutReaders: in a cluster where no node has read
// images for the model, a request with images is refused for good (400),
// not for now.
func TestVisionClusterWithoutReaders(t *testing.T) {
	n := startNode(t, "--model", smallModel(t), "--model-name", "v", "--gossip-addr", freeAddr(t), "--gossip-key", "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=")
	pic := dataURL("png", testImage(t, 8, 8, color.RGBA{1, 2, 3, 255}, "png"))
	body := fmt.Sprintf(`{"model":"v","max_tokens":2,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":%q}}]}]}`, pic)
	if resp, out := post(t, n.url+"/v1/chat/completions", body); resp.StatusCode != 400 || !strings.Contains(out, "--mmproj") {
		t.Errorf("no node reads images: %d %s, want 400 naming --mmproj", resp.StatusCode, out)
	}
}

// TestQwenVLNode: a node serving a Qwen2-VL model (images placed by M-RoPE,
// as grids of the picture's own shape) answers chats with pictures: apart
// for other pictures, alike for the same, the same whether alone or 8 at
// once, streamed, with the prefix through the picture from the cache.
func TestQwenVLNode(t *testing.T) {
	model := genFile(t, "q.gguf", "--preset", "qwen2vl-tiny")
	proj := genFile(t, "q-mmproj.gguf", "--preset", "qwen2vl-tiny", "--mmproj")
	n := startNode(t, "--model", model, "--model-name", "q", "--mmproj", proj, "--max-batch-tokens", "32", "--max-running", "8")
	c := n.client("")
	params := func(pic string) openai.ChatCompletionNewParams {
		return openai.ChatCompletionNewParams{
			Model: "q", MaxTokens: openai.Int(8), Temperature: openai.Float(0),
			Messages: []openai.ChatCompletionMessageParamUnion{
				openai.SystemMessage("You are a careful assistant who describes pictures in a few words."),
				openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
					openai.TextContentPart("What is this?"),
					openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: pic}),
				})},
		}
	}
	var prompt int64
	ask := func(pic string) (string, int64) {
		r, err := c.Chat.Completions.New(context.Background(), params(pic))
		if err != nil {
			t.Fatal(err)
		}
		prompt = r.Usage.PromptTokens
		return r.Choices[0].Message.Content, r.Usage.PromptTokensDetails.CachedTokens
	}
	wide := dataURL("png", testImage(t, 96, 40, color.RGBA{220, 20, 20, 255}, "png"))
	tall := dataURL("jpeg", testImage(t, 36, 90, color.RGBA{20, 20, 220, 255}, "jpeg"))
	a, _ := ask(wide)
	b, _ := ask(tall)
	again, cached := ask(wide)
	if a == b || again != a {
		t.Errorf("answers %q, %q, then %q: want the pictures read apart, the same picture alike", a, b, again)
	}
	if cached+32 < prompt {
		t.Errorf("the same chat again: %d of %d prompt tokens cached, want all but the last block or two, the picture among them", cached, prompt)
	}
	var wg sync.WaitGroup
	got := make([]string, 8)
	for i := range got {
		wg.Go(func() { got[i], _ = ask([]string{wide, tall}[i%2]) })
	}
	wg.Wait()
	for i, g := range got {
		if want := []string{a, b}[i%2]; g != want {
			t.Errorf("request %d of 8 at once: %q, alone %q", i, g, want)
		}
	}
	st := c.Chat.Completions.NewStreaming(context.Background(), params(tall))
	var streamed string
	for st.Next() {
		if ch := st.Current(); len(ch.Choices) > 0 {
			streamed += ch.Choices[0].Delta.Content
		}
	}
	if st.Err() != nil || streamed != b {
		t.Errorf("streamed %q (%v), want %q", streamed, st.Err(), b)
	}
}
