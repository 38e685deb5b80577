package api

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"image"
	"image/draw"
	_ "image/gif" // decoders image.Decode reads: the formats OpenAI's API takes, and BMP
	_ "image/jpeg"
	_ "image/png"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
	_ "golang.org/x/image/bmp"
	xdraw "golang.org/x/image/draw"
	_ "golang.org/x/image/webp"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// A request's images travel in its messages' text, each as a marker that
// holds the image's bytes (base64): a chat template lays them out in place
// like any text, and the prompt's images are then cut out of the rendered
// text in the order they appear (takeImages), so that a template that drops
// or reorders messages drops or reorders their images with them. The marker
// holds this process's own random text, which no client knows, so no text a
// client sends can pass for an image.
var (
	imageNonce = func() string {
		var b [8]byte
		_, _ = rand.Read(b[:])
		return hex.EncodeToString(b[:])
	}()
	imagePrefix = "<__image_" + imageNonce + ":" // every marker's start
	imageRE     = regexp.MustCompile(regexp.QuoteMeta(imagePrefix) + `(u:)?([A-Za-z0-9+/=]*)__>`)
)

// imageMarker is the marker of an image of bytes data.
func imageMarker(data []byte) string {
	return imagePrefix + base64.StdEncoding.EncodeToString(data) + "__>"
}

// imageSource is an image of a request: its bytes, or the web URL to fetch
// them from where the request is computed (Config.AllowedMediaDomains).
type imageSource struct {
	data []byte
	url  string
}

// imageURLMarker is the marker of the image at url: a data: URL's bytes, or
// an http(s) URL, fetched where the request is computed if its host is
// allowed there.
func imageURLMarker(url string) (string, error) {
	if strings.HasPrefix(url, "http://") || strings.HasPrefix(url, "https://") {
		return imagePrefix + "u:" + base64.StdEncoding.EncodeToString([]byte(url)) + "__>", nil
	}
	data, err := imageURL(url)
	if err != nil {
		return "", err
	}
	return imageMarker(data), nil
}

// hasImages reports whether text holds an image marker.
func hasImages(text string) bool { return strings.Contains(text, imagePrefix) }

// takeImages replaces each image marker in text by marker and returns the
// images' bytes in the order they appear. The text is matched once (a
// marker holds a whole image in base64).
func takeImages(text, marker string) (string, []imageSource) {
	var images []imageSource
	var out strings.Builder
	at := 0
	for _, m := range imageRE.FindAllStringSubmatchIndex(text, -1) {
		out.WriteString(text[at:m[0]])
		out.WriteString(marker)
		at = m[1]
		data, _ := base64.StdEncoding.DecodeString(text[m[4]:m[5]])
		if m[2] >= 0 { // u: a web URL
			images = append(images, imageSource{url: string(data)})
		} else {
			images = append(images, imageSource{data: data})
		}
	}
	out.WriteString(text[at:])
	return out.String(), images
}

// imageURL reads a data: URL of base64 bytes (as OpenAI's clients send a
// local file).
func imageURL(url string) ([]byte, error) {
	rest, ok := strings.CutPrefix(url, "data:")
	if !ok {
		return nil, fmt.Errorf("image_url: a data: URL of the image's bytes (data:image/png;base64,...) or an http(s) URL expected")
	}
	meta, payload, ok := strings.Cut(rest, ",")
	if !ok || !strings.HasSuffix(meta, ";base64") {
		return nil, fmt.Errorf("image_url: a data: URL of base64 bytes expected (data:image/png;base64,...)")
	}
	data, err := decodeBase64(payload)
	if err != nil {
		return nil, fmt.Errorf("image_url: the data: URL's base64: %w", err)
	}
	return data, nil
}

// decodeBase64 reads standard or URL-safe base64, padded or not.
func decodeBase64(s string) ([]byte, error) {
	s = strings.TrimRight(strings.TrimSpace(s), "=")
	if strings.ContainsAny(s, "-_") {
		return base64.RawURLEncoding.DecodeString(s)
	}
	return base64.RawStdEncoding.DecodeString(s)
}

// maxImageSide bounds the sides of a decoded image: a larger one is scaled
// down at once (a projector scales every image to its own input size, 1540
// pixels at most for those llama.cpp has), so a request's decoded images
// take at most maxImages × 12 MiB.
const maxImageSide = 2048

// decodeImage decodes an image's bytes (PNG, JPEG, GIF, WebP or BMP; a GIF's
// first frame) into RGB pixels, refusing one larger than
// engine.MaxImagePixels before decoding it, scaling a side over maxImageSide
// down, and putting transparent pixels on white, as Ollama does.
func decodeImage(data []byte) (engine.Image, error) {
	cfg, format, err := image.DecodeConfig(bytes.NewReader(data))
	if err != nil {
		return engine.Image{}, fmt.Errorf("not an image this server reads (PNG, JPEG, GIF, WebP or BMP): %w", err)
	}
	if cfg.Width < 1 || cfg.Height < 1 || cfg.Width*cfg.Height > engine.MaxImagePixels {
		return engine.Image{}, fmt.Errorf("a %s of %d×%d pixels: at most %d pixels are read", format, cfg.Width, cfg.Height, engine.MaxImagePixels)
	}
	im, _, err := image.Decode(bytes.NewReader(data))
	if err != nil {
		return engine.Image{}, fmt.Errorf("a %s that does not decode: %w", format, err)
	}
	r := im.Bounds()
	w, h := r.Dx(), r.Dy()
	if long := max(w, h); long > maxImageSide {
		w, h = max(1, w*maxImageSide/long), max(1, h*maxImageSide/long)
	}
	rgba := image.NewRGBA(image.Rect(0, 0, w, h))
	op := draw.Src
	if o, ok := im.(interface{ Opaque() bool }); !ok || !o.Opaque() {
		draw.Draw(rgba, rgba.Bounds(), image.White, image.Point{}, draw.Src)
		op = draw.Over
	}
	if w != r.Dx() || h != r.Dy() {
		xdraw.BiLinear.Scale(rgba, rgba.Bounds(), im, r, xdraw.Op(op), nil) // not ApproxBiLinear, which loses thin lines (text in screenshots)
	} else {
		draw.Draw(rgba, rgba.Bounds(), im, r.Min, op)
	}
	out := engine.Image{Width: w, Height: h, RGB: make([]byte, 3*w*h)}
	for i := range w * h {
		copy(out.RGB[3*i:3*i+3], rgba.Pix[4*i:4*i+3])
	}
	return out, nil
}

// imagePlan is a prompt with images: its text, with imageSlot where each
// image stands, and the images' bytes in order.
type imagePlan struct {
	text  string
	data  []imageSource
	fetch func(ctx context.Context, url string, limit int64) ([]byte, error) // a web URL's bytes
	// laidOut: the plan's prompt is laid out with its images (imageTokens).
	laidOut bool
}

// fetches reports whether the plan has an image to fetch from the web.
func (ip *imagePlan) fetches() bool {
	return slices.ContainsFunc(ip.data, func(src imageSource) bool { return src.url != "" })
}

// imageSlot stands for an image in an imagePlan's text until the projector's
// marker replaces it.
var imageSlot = "<__image_" + imageNonce + "__>"

// chatTokens tokenizes a rendered chat prompt. One with images becomes
// p.images, computed where the request runs (imagePrompt: a node that
// forwards it to a node reading images decodes none); its tokens here are
// those of the text around the images, which route it.
func (s *Server) chatTokens(b *Backend, p *plan, text string) ([]engine.Token, error) {
	if !hasImages(text) {
		return b.Vocab.Tokenize(text, true, true)
	}
	param := p.param("messages")
	if p.req.PromptLogprobs {
		return nil, invalid("prompt_logprobs", "a prompt with images is not scored (prompt_logprobs)")
	}
	text, srcs := takeImages(text, imageSlot)
	if err := checkImageCount(len(srcs), param); err != nil {
		return nil, err
	}
	// Only where the images may be read: a node without a projector
	// forwards them to one, which checks them against its own list.
	for i, src := range srcs {
		if err := s.mayFetch(src.url); err != nil && b.Projector != nil {
			return nil, invalid(param, "image %d: %v", i, err)
		}
	}
	p.images = &imagePlan{text: text, data: srcs, fetch: s.fetchImage}
	return b.Vocab.Tokenize(strings.ReplaceAll(text, imageSlot, ""), true, true)
}

// maxImages bounds a request's images.
const maxImages = 64

func checkImageCount(n int, param string) error {
	if n > maxImages {
		return invalid(param, "%d images: at most %d are read per request", n, maxImages)
	}
	return nil
}

// countWithImages is how many tokens a rendered chat prompt with images
// makes on b: its images are decoded and laid out, not encoded.
func countWithImages(ctx context.Context, b *Backend, text string) (int, error) {
	text, srcs := takeImages(text, imageSlot)
	toks, err := layOutImages(ctx, b, &imagePlan{text: text, data: srcs}, "messages")
	return len(toks), err
}

// layOutImages is ip's prompt on b, its images' placeholders in place, none
// encoded.
func layOutImages(ctx context.Context, b *Backend, ip *imagePlan, param string) ([]engine.Token, error) {
	if b.Projector == nil {
		return nil, errNoProjector(param)
	}
	var toks []engine.Token
	err := withImages(ctx, b, ip, param, func(images []engine.Image) error {
		var err error
		toks, err = b.Projector.Layout(strings.ReplaceAll(ip.text, imageSlot, b.Projector.Marker()), images, true, true)
		if err != nil {
			return fmt.Errorf("lay out images: %w", err)
		}
		return nil
	})
	return toks, err
}

// imageTokens is p's prompt with images laid out on b (routing tokens that
// match what the nodes reading images cache: their placeholders are the
// pictures'); ok is false when it answered c with an error. The images are
// decoded again where the request is computed: holding them across a
// forward would hold them outside the decoding slots.
func (s *Server) imageTokens(c *gin.Context, b *Backend, p *plan) (ok bool) {
	toks, err := layOutImages(c.Request.Context(), b, p.images, p.param("messages"))
	if err != nil {
		abort(c, err)
		return false
	}
	p.prompts[0], p.images.laidOut = toks, true
	return true
}

// errNoProjector refuses a request with images for model on a node without
// a projector: for now (503) in a cluster with a member that reads images for
// the model (it was tried first: busy, failing or gone), else for good (400).
func (s *Server) errNoProjector(param, model string) error {
	if n := s.node(); n != nil && slices.ContainsFunc(n.Members(), func(m cluster.Member) bool {
		return m.Vision && slices.Contains(m.Models, model)
	}) {
		return &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", Code: "no_vision_node", RetryAfter: 1,
			Message: "no node of the cluster that reads images for this model (shoal serve --mmproj) could take the request now"}
	}
	return errNoProjector(param)
}

func errNoProjector(param string) error {
	return invalid(param, "this model reads no images: the node serves it without a multimodal projector (shoal serve --mmproj)")
}

// maxDecoding bounds the requests of a backend that hold decoded images at
// once (decoded and laid out, or being encoded): each may hold maxImages
// images of up to maxImageSide² pixels.
const maxDecoding = 2

// withImages fetches ip's web images (before taking a slot: a slow host
// holds up only its own request), then decodes its images, in order, and
// calls fn with them, holding one of b's slots for decoded images; it waits
// for one, or for ctx.
func withImages(ctx context.Context, b *Backend, ip *imagePlan, param string, fn func([]engine.Image) error) error {
	if err := checkImageCount(len(ip.data), param); err != nil {
		return err
	}
	data, err := ip.bytes(ctx, param)
	if err != nil {
		return err
	}
	select {
	case b.imageSlots <- struct{}{}:
		defer func() { <-b.imageSlots }()
	case <-ctx.Done():
		return fmt.Errorf("wait to decode images: %w", ctx.Err())
	}
	images := make([]engine.Image, len(data))
	for i, d := range data {
		im, err := decodeImage(d)
		if err != nil {
			return invalid(param, "image %d: %v", i, err)
		}
		images[i] = im
	}
	return fn(images)
}

// fetchBudget bounds fetching all of a request's web images.
const fetchBudget = 30 * time.Second

// bytes is each image's bytes, the web ones fetched (a URL given twice once),
// within fetchBudget and, together, maxFetchBytes.
func (ip *imagePlan) bytes(ctx context.Context, param string) ([][]byte, error) {
	out := make([][]byte, len(ip.data))
	ctx, cancel := context.WithTimeout(ctx, fetchBudget)
	defer cancel()
	got := map[string][]byte{}
	left := int64(maxFetchBytes)
	for i, src := range ip.data {
		out[i] = src.data
		if src.url == "" {
			continue
		}
		if ip.fetch == nil {
			return nil, invalid(param, "web image URLs are fetched for generation only: send the images as data: URLs")
		}
		if d, ok := got[src.url]; ok {
			out[i] = d
			continue
		}
		d, err := ip.fetch(ctx, src.url, left)
		if err != nil {
			return nil, invalid(param, "image %d: %v", i, err)
		}
		got[src.url], out[i], left = d, d, left-int64(len(d))
	}
	return out, nil
}

// maxFetchBytes bounds the bytes of a request's fetched images together.
const maxFetchBytes = 64 << 20

// imagePrompt lays out p's prompt with its images (fetched and decoded here,
// and their embeddings computed by the projector), or returns
// the *engine.PromptTooLongError of a prompt of maxCtx tokens or more before
// computing any.
func (s *Server) imagePrompt(ctx context.Context, b *Backend, p *plan, maxCtx int) error {
	param := p.param("messages")
	if b.Projector == nil {
		return s.errNoProjector(param, p.model)
	}
	// A full queue refuses it now, before its images are fetched, decoded
	// and encoded for nothing (Submit would refuse it after).
	if l := b.Generator.Load(); l.Waiting+max(p.n, 1) > l.MaxWaiting {
		return scheduler.ErrQueueFull
	}
	return withImages(ctx, b, p.images, param, func(images []engine.Image) error {
		start := time.Now()
		text := strings.ReplaceAll(p.images.text, imageSlot, b.Projector.Marker())
		toks, media, err := b.Projector.Prompt(ctx, text, images, maxCtx, true, true)
		if err != nil {
			return fmt.Errorf("lay out images: %w", err)
		}
		took := time.Since(start)
		s.metrics.images.Add(float64(len(images)))
		s.metrics.encode.Observe(took.Seconds())
		if st := statsOf(ctx); st != nil {
			st.images.Add(int64(len(images)))
			st.imageTime.Add(int64(took))
		}
		p.prompts[0], p.req.Media = toks, media
		return nil
	})
}

// mayFetch refuses a web URL whose host is not among the allowed media
// domains ("" is no URL).
func (s *Server) mayFetch(raw string) error {
	if raw == "" {
		return nil
	}
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return fmt.Errorf("image URL %q does not parse", raw)
	}
	if len(s.cfg.AllowedMediaDomains) == 0 {
		return errors.New("this node fetches no web URL: send the image itself as a data: URL (data:image/png;base64,...), or start the nodes with --allowed-media-domains")
	}
	if !slices.Contains(s.cfg.AllowedMediaDomains, "*") && !slices.Contains(s.cfg.AllowedMediaDomains, strings.ToLower(u.Hostname())) {
		return fmt.Errorf("image URL host %s is not among --allowed-media-domains", u.Hostname())
	}
	return nil
}

// errRedirect marks a redirect refused (its reason is the client's to see).
var errRedirect = errors.New("redirect refused")

// fetchTimeout bounds fetching one image (vLLM's default is 5 s).
const fetchTimeout = 10 * time.Second

// fetchImage is the bytes at an allowed web URL: status 200, at most limit
// bytes, within fetchTimeout; a redirect is followed only to an allowed
// host, three at most. Errors name no more of the network than the URL and
// status (a connection's own error is logged, not sent to the client).
func (s *Server) fetchImage(ctx context.Context, raw string, limit int64) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, fetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, raw, nil)
	if err != nil {
		return nil, fmt.Errorf("fetch %s: %w", raw, err)
	}
	client := &http.Client{CheckRedirect: func(r *http.Request, via []*http.Request) error {
		if len(via) > 3 {
			return fmt.Errorf("%w: more than 3", errRedirect)
		}
		if err := s.mayFetch(r.URL.String()); err != nil {
			return fmt.Errorf("%w: %w", errRedirect, err)
		}
		return nil
	}}
	resp, err := client.Do(req)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) && errors.Is(uerr.Err, errRedirect) {
			return nil, fmt.Errorf("fetch %s: %w", raw, uerr.Err)
		}
		s.log.Debug("image fetch failed", "url", raw, "err", err)
		if ctx.Err() != nil {
			return nil, fmt.Errorf("fetch %s: timed out", raw)
		}
		return nil, fmt.Errorf("fetch %s: the host could not be reached", raw)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("fetch %s: status %d", raw, resp.StatusCode)
	}
	limit = min(limit, max(s.cfg.MaxBodyBytes, s.cfg.VisionBodyBytes)) // this node reads images
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("fetch %s: reading it failed", raw)
	case int64(len(data)) > limit:
		return nil, fmt.Errorf("fetch %s: more than %d bytes", raw, limit)
	}
	return data, nil
}
