package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"image"
	"image/color"
	"image/gif"
	"image/jpeg"
	"image/png"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// fakeProjector lays out a prompt as a projector does, each image as four
// placeholder rows of its content, and records what it was given.
type fakeProjector struct {
	vocab engine.Vocab
	width int
	mu    sync.Mutex
	text  string
	sizes [][2]int
}

func (p *fakeProjector) Marker() string { return "<@img@>" }

func (p *fakeProjector) Layout(text string, images []engine.Image, addSpecial, parseSpecial bool) ([]engine.Token, error) {
	toks, _, err := p.Prompt(context.Background(), text, images, 0, addSpecial, parseSpecial)
	return toks, err
}

func (p *fakeProjector) Prompt(_ context.Context, text string, images []engine.Image, limit int, addSpecial, parseSpecial bool) ([]engine.Token, []engine.Media, error) {
	p.mu.Lock()
	p.text, p.sizes = text, nil
	for _, im := range images {
		p.sizes = append(p.sizes, [2]int{im.Width, im.Height})
	}
	p.mu.Unlock()
	parts := strings.Split(text, p.Marker())
	if len(parts) != len(images)+1 {
		return nil, nil, fmt.Errorf("%d images for %d markers: %w", len(images), len(parts)-1, engine.ErrInvalidInput)
	}
	var toks []engine.Token
	var media []engine.Media
	for i, part := range parts {
		t, err := p.vocab.Tokenize(part, addSpecial && i == 0, parseSpecial)
		if err != nil {
			return nil, nil, err
		}
		toks = append(toks, t...)
		if i < len(images) {
			h := sha256.Sum256(images[i].RGB)
			m := engine.Media{Pos: len(toks), Len: 4, Embd: make([]float32, 4*p.width)}
			for j := range m.Len {
				toks = append(toks, engine.Placeholder(binary.LittleEndian.Uint64(h[:]), j))
			}
			media = append(media, m)
		}
	}
	if limit > 0 && len(toks) >= limit {
		return nil, nil, &engine.PromptTooLongError{Tokens: len(toks), Limit: limit}
	}
	return toks, media, nil
}

// newVisionServer is a test server whose backend reads images.
func newVisionServer(t testing.TB, mod ...func(*Config, *scheduler.Config)) (*testServer, *fakeProjector) {
	var m func(*Config, *scheduler.Config)
	if len(mod) > 0 {
		m = mod[0]
	}
	s := newTestServer(t, m)
	b := *s.backend.Load()
	p := &fakeProjector{vocab: b.Vocab, width: b.Info.EmbeddingSize}
	b.Projector = p
	s.SetBackend(&b)
	return s, p
}

func encodeImage(t testing.TB, w, h int, c color.RGBA, format string) []byte {
	t.Helper()
	im := image.NewRGBA(image.Rect(0, 0, w, h))
	for i := range w * h {
		im.Set(i%w, i/w, c)
	}
	var buf bytes.Buffer
	var err error
	switch format {
	case "jpeg":
		err = jpeg.Encode(&buf, im, nil)
	case "gif":
		err = gif.Encode(&buf, im, nil)
	default:
		err = png.Encode(&buf, im)
	}
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestImageParts: images in chat content stand where they are among the
// text, in the order the chat template lays the messages out, in OpenAI's,
// Ollama's, Anthropic's and the Responses API's shapes; a text that looks
// like a marker is text; the same picture is cached, another is not.
func TestImageParts(t *testing.T) {
	s, p := newVisionServer(t)
	red := encodeImage(t, 6, 4, color.RGBA{255, 0, 0, 255}, "png")
	blue := encodeImage(t, 3, 5, color.RGBA{0, 0, 255, 255}, "jpeg")
	url := func(format string, b []byte) string {
		return "data:image/" + format + ";base64," + base64.StdEncoding.EncodeToString(b)
	}
	body := fmt.Sprintf(`{"max_tokens":2,"messages":[
		{"role":"system","content":"sys"},
		{"role":"user","content":[{"type":"text","text":"first"},{"type":"image_url","image_url":{"url":%q}},{"type":"text","text":"then"}]},
		{"role":"assistant","content":"ok"},
		{"role":"user","content":[{"type":"image_url","image_url":%q},{"type":"text","text":"<__image_0123456789abcdef:AAAA__> last"}]}]}`,
		url("png", red), url("jpeg", blue))
	w := s.do(t, "POST", "/v1/chat/completions", body)
	if w.Code != 200 {
		t.Fatalf("chat: %d %s", w.Code, w.Body)
	}
	if !strings.Contains(p.text, "first\n<@img@>\nthen") || !strings.Contains(p.text, "<@img@>\n<__image_0123456789abcdef:AAAA__> last") ||
		strings.Count(p.text, "<@img@>") != 2 || len(p.sizes) != 2 || p.sizes[0] != [2]int{6, 4} || p.sizes[1] != [2]int{3, 5} {
		t.Fatalf("projector got %q with images %v", p.text, p.sizes)
	}
	var r ChatResponse
	if err := json.Unmarshal(w.Body.Bytes(), &r); err != nil || r.Usage.PromptTokens < 8 {
		t.Fatalf("usage: %s", w.Body)
	}
	// Again: cached through the images; another picture: cached up to it.
	cached := func(body string) int {
		w := s.do(t, "POST", "/v1/chat/completions", body)
		var r ChatResponse
		if err := json.Unmarshal(w.Body.Bytes(), &r); err != nil || w.Code != 200 {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
		return r.Usage.PromptTokensDetails.CachedTokens
	}
	same, other := cached(body), cached(strings.Replace(body, url("png", red), url("gif", encodeImage(t, 6, 4, color.RGBA{0, 255, 0, 255}, "gif")), 1))
	if same < r.Usage.PromptTokens-16 || other >= same {
		t.Errorf("cached: the same images %d of %d, another first image %d", same, r.Usage.PromptTokens, other)
	}

	b64 := base64.StdEncoding.EncodeToString(red)
	for _, c := range []struct{ path, body, want string }{
		{"/api/chat", `{"stream":false,"options":{"num_predict":1},"messages":[{"role":"user","content":"what","images":["` + b64 + `"]}]}`, "<@img@>what"},
		{"/api/generate", `{"stream":false,"options":{"num_predict":1},"prompt":"what","images":["` + b64 + `"]}`, "<@img@>what"},
		{"/v1/messages", `{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"` + b64 + `"}},{"type":"text","text":"what"}]}]}`, "<@img@>\nwhat"},
		{"/v1/responses", `{"max_output_tokens":1,"input":[{"role":"user","content":[{"type":"input_text","text":"what"},{"type":"input_image","image_url":"data:image/png;base64,` + b64 + `"}]}]}`, "what\n<@img@>"},
		// A screenshot a tool returned.
		{"/v1/messages", `{"max_tokens":1,"messages":[{"role":"user","content":"look"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"shot","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"taken"},{"type":"image","source":{"type":"base64","data":"` + b64 + `"}}]}]}]}`, `taken\n<@img@>`}, // in the tool turn's JSON
	} {
		if w := s.do(t, "POST", c.path, c.body); w.Code != 200 || !strings.Contains(p.text, c.want) {
			t.Errorf("%s: %d %s; projector got %q, want it to hold %q", c.path, w.Code, w.Body, p.text, c.want)
		}
	}
	// Anthropic's token count counts the image's tokens.
	count := func(content string) int {
		w := s.do(t, "POST", "/v1/messages/count_tokens", `{"messages":[{"role":"user","content":`+content+`}]}`)
		var r struct {
			InputTokens int `json:"input_tokens"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &r); err != nil || w.Code != 200 {
			t.Fatalf("count_tokens: %d %s", w.Code, w.Body)
		}
		return r.InputTokens
	}
	withImage := count(`[{"type":"image","source":{"type":"base64","data":"` + b64 + `"}},{"type":"text","text":"what"}]`)
	if plain := count(`"what"`); withImage != plain+4+1 { // the image's 4 rows and the newline before the text
		t.Errorf("count_tokens: %d with the image, %d without", withImage, plain)
	}
	for _, c := range []struct{ path, body, want string }{
		{"/api/generate", `{"raw":true,"prompt":"what","images":["` + b64 + `"]}`, "not with raw"},
		{"/api/chat", `{"messages":[{"role":"user","content":"what","images":[1]}]}`, "base64 string"},
		{"/v1/messages", `{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://x"}}]}]}`, "base64"},
		{"/v1/messages", `{"max_tokens":1,"system":[{"type":"image","source":{"type":"base64","data":"` + b64 + `"}}],"messages":[{"role":"user","content":"x"}]}`, "only text blocks"},
		{"/v1/responses", `{"input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x/y.png"}]}]}`, "data: URL"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png,abc"}}]}]}`, "base64"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}`, "url"},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,` + base64.StdEncoding.EncodeToString(red[:20]) + `"}}]}]}`, "image 0"},
	} {
		w := s.do(t, "POST", c.path, c.body)
		if w.Code != 400 || !strings.Contains(w.Body.String(), c.want) {
			t.Errorf("%s %s: %d %s, want 400 saying %q", c.path, c.body[:min(60, len(c.body))], w.Code, w.Body, c.want)
		}
	}
}

// TestDecodeImage: each format OpenAI's API takes decodes to its pixels; a
// picture over the bound is refused before it is decoded.
func TestDecodeImage(t *testing.T) {
	c := color.RGBA{10, 200, 30, 255}
	for _, format := range []string{"png", "jpeg", "gif"} {
		im, err := decodeImage(encodeImage(t, 7, 3, c, format))
		if err != nil || im.Width != 7 || im.Height != 3 || len(im.RGB) != 63 {
			t.Fatalf("%s: %v %d×%d", format, err, im.Width, im.Height)
		}
		if d := int(im.RGB[1]) - int(c.G); format == "png" && d != 0 || d < -8 || d > 8 { // JPEG's and GIF's are near
			t.Errorf("%s: green %d, want %d", format, im.RGB[1], c.G)
		}
	}
	// A long picture is scaled down to maxImageSide; a transparent pixel is on white.
	if im, err := decodeImage(encodeImage(t, 3000, 30, c, "png")); err != nil || im.Width != maxImageSide || im.Height != 20 || im.RGB[1] != c.G {
		t.Errorf("3000×30: %v %d×%d", err, im.Width, im.Height)
	}
	var clear bytes.Buffer
	png.Encode(&clear, image.NewNRGBA(image.Rect(0, 0, 2, 2)))
	if im, err := decodeImage(clear.Bytes()); err != nil || im.RGB[0] != 255 || im.RGB[11] != 255 {
		t.Errorf("transparent: %v %v, want white", err, im.RGB)
	}
	// A PNG header that claims 10⁵×10⁵ pixels.
	var hdr bytes.Buffer
	png.Encode(&hdr, image.NewGray(image.Rect(0, 0, 1, 1)))
	b := hdr.Bytes()
	binary.BigEndian.PutUint32(b[16:], 100000)
	binary.BigEndian.PutUint32(b[20:], 100000)
	binary.BigEndian.PutUint32(b[29:], crc32.ChecksumIEEE(b[12:29]))
	if _, err := decodeImage(b); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Errorf("huge: %v", err)
	}
	if _, err := decodeImage([]byte("GIF89a")); err == nil {
		t.Error("a truncated GIF decoded")
	}
	for _, s := range []string{"aGk=", "aGk", "aG-_", " aGk= "} {
		if _, err := decodeBase64(s); err != nil {
			t.Errorf("base64 %q: %v", s, err)
		}
	}
	if _, err := imageURL("file:///etc/passwd"); err == nil {
		t.Error("a file URL was read")
	}
	if text, images := takeImages("a"+imageMarker([]byte{1})+"b"+imageMarker([]byte{2, 3}), "|"); text != "a|b|" || len(images) != 2 || !bytes.Equal(images[1].data, []byte{2, 3}) {
		t.Errorf("takeImages: %q %v", text, images)
	}
}

// FuzzDecodeImage: no bytes make the image decoding fail otherwise than
// with an error, and what decodes has its pixels.
func FuzzDecodeImage(f *testing.F) {
	for _, format := range []string{"png", "jpeg", "gif"} {
		f.Add(encodeImage(f, 3, 2, color.RGBA{1, 2, 3, 255}, format))
	}
	f.Add([]byte("BM"))
	f.Add([]byte("RIFF\x00\x00\x00\x00WEBPVP8 "))
	f.Fuzz(func(t *testing.T, data []byte) {
		im, err := decodeImage(data)
		if err == nil && (im.Width*im.Height*3 != len(im.RGB) || im.Width*im.Height > engine.MaxImagePixels) {
			t.Fatalf("%d×%d with %d bytes", im.Width, im.Height, len(im.RGB))
		}
	})
}

// FuzzVisionRequests: no chat request with images, in any API's shape,
// answers otherwise than 200 or an error in OpenAI's format.
func FuzzVisionRequests(f *testing.F) {
	s, _ := newVisionServer(f)
	png64 := base64.StdEncoding.EncodeToString(encodeImage(f, 2, 2, color.RGBA{9, 9, 9, 255}, "png"))
	fuzzOpenAIErrors(f, s, "/v1/chat/completions", "/v1/responses",
		`{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"data:image/png;base64,`+png64+`"}}]}]}`,
		`{"max_tokens":1,"n":2,"messages":[{"role":"user","content":[{"type":"image_url","image_url":"data:image/png;base64,`+png64+`"}]}],"continue_final_message":true,"add_generation_prompt":false}`,
		`{"max_output_tokens":1,"input":[{"role":"user","content":[{"type":"input_image","image_url":"data:image/png;base64,`+png64+`"}]}]}`)
}

// TestImageURLs: web image URLs are fetched from the allowed hosts only,
// redirects too; a node allowing none says how to send the image.
func TestImageURLs(t *testing.T) {
	pic := encodeImage(t, 5, 7, color.RGBA{1, 2, 3, 255}, "png")
	mux := http.NewServeMux()
	mux.HandleFunc("/pic.png", func(w http.ResponseWriter, r *http.Request) { w.Write(pic) })
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) { w.Write(make([]byte, 2<<20)) })
	mux.HandleFunc("/here", func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/pic.png", http.StatusFound) })
	web := httptest.NewServer(mux)
	defer web.Close()
	_, port, _ := net.SplitHostPort(web.Listener.Addr().String())
	mux.HandleFunc("/away", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "http://localhost:"+port+"/pic.png", http.StatusFound)
	})
	s, p := newVisionServer(t, func(c *Config, _ *scheduler.Config) {
		c.AllowedMediaDomains, c.MaxBodyBytes = []string{"127.0.0.1"}, 1<<20
	})
	chat := func(url string) string {
		return `{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"` + url + `"}}]}]}`
	}
	for _, path := range []string{"/pic.png", "/here"} {
		if w := s.do(t, "POST", "/v1/chat/completions", chat(web.URL+path)); w.Code != 200 || len(p.sizes) != 1 || p.sizes[0] != [2]int{5, 7} {
			t.Errorf("%s: %d %s; projector got %v", path, w.Code, w.Body, p.sizes)
		}
	}
	anthropic := `{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"` + web.URL + `/pic.png"}}]}]}`
	if w := s.do(t, "POST", "/v1/messages", anthropic); w.Code != 200 {
		t.Errorf("Anthropic's url source: %d %s", w.Code, w.Body)
	}
	for _, c := range []struct{ url, want string }{
		{web.URL + "/nothing", "status 404"},
		{web.URL + "/big", "more than"},
		{web.URL + "/away", "localhost is not among"},
		{"http://localhost:" + port + "/pic.png", "localhost is not among"},
		{"ftp://127.0.0.1/x.png", "data: URL"},
	} {
		if w := s.do(t, "POST", "/v1/chat/completions", chat(c.url)); w.Code != 400 || !strings.Contains(w.Body.String(), c.want) {
			t.Errorf("%s: %d %s, want 400 saying %q", c.url, w.Code, w.Body, c.want)
		}
	}
	closed, _ := newVisionServer(t)
	if w := closed.do(t, "POST", "/v1/chat/completions", chat(web.URL+"/pic.png")); w.Code != 400 || !strings.Contains(w.Body.String(), "--allowed-media-domains") {
		t.Errorf("a node allowing no host: %d %s", w.Code, w.Body)
	}
}

// TestImageFetchHoldsNoSlot: requests waiting on a slow image host hold none
// of the node's slots for decoded images, and a URL given twice is fetched
// once.
func TestImageFetchHoldsNoSlot(t *testing.T) {
	pic := encodeImage(t, 3, 3, color.RGBA{9, 8, 7, 255}, "png")
	entered, release := make(chan struct{}, 8), make(chan struct{})
	var hits atomic.Int32
	mux := http.NewServeMux()
	mux.HandleFunc("/slow.png", func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
		w.Write(pic)
	})
	mux.HandleFunc("/pic.png", func(w http.ResponseWriter, r *http.Request) { hits.Add(1); w.Write(pic) })
	web := httptest.NewServer(mux)
	defer web.Close()
	defer close(release)
	s, p := newVisionServer(t, func(c *Config, _ *scheduler.Config) { c.AllowedMediaDomains = []string{"127.0.0.1"} })
	chat := func(urls ...string) string {
		var parts []string
		for _, u := range urls {
			parts = append(parts, `{"type":"image_url","image_url":{"url":"`+u+`"}}`)
		}
		return `{"max_tokens":1,"messages":[{"role":"user","content":[` + strings.Join(parts, ",") + `]}]}`
	}
	for range maxDecoding {
		go s.do(t, "POST", "/v1/chat/completions", chat(web.URL+"/slow.png"))
	}
	for range maxDecoding {
		<-entered
	}
	done := make(chan int, 1)
	go func() {
		done <- s.do(t, "POST", "/v1/chat/completions", chat(web.URL+"/pic.png", web.URL+"/pic.png")).Code
	}()
	select {
	case code := <-done:
		if code != 200 || hits.Load() != 1 || len(p.sizes) != 2 {
			t.Errorf("beside slow fetches: %d, the URL fetched %d times, %d images", code, hits.Load(), len(p.sizes))
		}
	case <-time.After(fetchTimeout / 2): // before the slow fetches would time out
		t.Fatal("a request with images waited for requests fetching theirs")
	}
}

// TestImagesQueueFull: a request with images that a full queue would refuse
// is refused before its images are decoded or encoded.
func TestImagesQueueFull(t *testing.T) {
	s, p := newVisionServer(t, func(c *Config, sc *scheduler.Config) { sc.MaxWaiting, sc.MaxRunning, sc.MaxBatchTokens = 1, 1, 16 })
	s.fake.Delay = 5 * time.Millisecond
	// One runs, then one waits: the queue (of one) is full.
	deadline := time.Now().Add(10 * time.Second)
	for _, filled := range []func(scheduler.Load) bool{
		func(l scheduler.Load) bool { return l.Running == 1 },
		func(l scheduler.Load) bool { return l.Waiting == 1 },
	} {
		go s.do(t, "POST", "/v1/completions", `{"prompt":"abc","max_tokens":400,"ignore_eos":true}`)
		for !filled(s.sched.Load()) {
			if time.Now().After(deadline) {
				t.Fatal("the queue did not fill")
			}
			time.Sleep(time.Millisecond)
		}
	}
	img := base64.StdEncoding.EncodeToString(encodeImage(t, 2, 2, color.RGBA{5, 5, 5, 255}, "png"))
	w := s.do(t, "POST", "/v1/chat/completions", `{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,`+img+`"}}]}]}`)
	if w.Code != 429 || !strings.Contains(w.Body.String(), "queue_full") || p.text != "" {
		t.Errorf("a full queue: %d %s; the projector was given %q", w.Code, w.Body, p.text)
	}
}

// TestVisionBodyLimit: bodies beyond MaxBodyBytes, up to VisionBodyBytes,
// are taken only where images are read; declared or not (chunked).
func TestVisionBodyLimit(t *testing.T) {
	limits := func(c *Config, _ *scheduler.Config) { c.MaxBodyBytes, c.VisionBodyBytes = 1024, 64<<10 }
	pic := "data:image/png;base64," + base64.StdEncoding.EncodeToString(encodeImage(t, 6, 4, color.RGBA{255, 0, 0, 255}, "png"))
	body := fmt.Sprintf(`{"max_tokens":2,"messages":[{"role":"user","content":[{"type":"text","text":%q},{"type":"image_url","image_url":{"url":%q}}]}]}`,
		strings.Repeat("a", 1500), pic)
	huge := strings.Replace(body, `"a`, `"`+strings.Repeat("b", 64<<10), 1)
	send := func(s *testServer, body string, chunked bool) int {
		req := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
		if chunked {
			req.ContentLength = -1
		}
		w := httptest.NewRecorder()
		s.Handler().ServeHTTP(w, req)
		if w.Code != http.StatusOK && w.Code != http.StatusRequestEntityTooLarge {
			t.Logf("%d: %s", w.Code, w.Body)
		}
		return w.Code
	}
	blind := newTestServer(t, limits)
	eyes, _ := newVisionServer(t, limits)
	for _, chunked := range []bool{false, true} {
		if code := send(blind, body, chunked); code != http.StatusRequestEntityTooLarge {
			t.Errorf("no projector, chunked %v: %d, want 413", chunked, code)
		}
		if code := send(eyes, body, chunked); code != http.StatusOK {
			t.Errorf("projector, chunked %v: %d, want 200", chunked, code)
		}
		if code := send(eyes, huge, chunked); code != http.StatusRequestEntityTooLarge {
			t.Errorf("projector, beyond VisionBodyBytes, chunked %v: %d, want 413", chunked, code)
		}
		// Beyond MaxBodyBytes without a picture: refused before decoding.
		text := fmt.Sprintf(`{"max_tokens":2,"messages":[{"role":"user","content":%q}]}`, strings.Repeat("a", 1500))
		if code := send(eyes, text, chunked); code != http.StatusRequestEntityTooLarge {
			t.Errorf("projector, text only beyond MaxBodyBytes, chunked %v: %d, want 413", chunked, code)
		}
	}
	if mayCarryImages([]byte(`{"messages":[{"role":"user","content":"plain"}]}`)) {
		t.Errorf("a chat without images may carry images")
	}
	for _, b := range []string{`{"images":[]}`, `[{"type":"image_url"}]`, `{"type":"input_image"}`, `{"type":"image","source":{}}`} {
		if !mayCarryImages([]byte(b)) {
			t.Errorf("%s: may carry no images", b)
		}
	}
}
