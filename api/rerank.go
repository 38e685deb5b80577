package api

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// A reranker (a model served with rank pooling, --reranking) reads a query and a
// document as one sequence and gives its relevance. Two shapes of request ask for
// it: rerank (Jina's and Cohere's, which vLLM, llama-server and TEI serve too: one
// query, many documents, answered best first) and vLLM's score (pairs of texts,
// answered in order).

// RerankRequest is a rerank request. Documents are strings or objects with a
// text (Jina's and Cohere's v1 shape); TEI's clients send texts instead.
type RerankRequest struct {
	Model     string           `json:"model"`
	Query     *string          `json:"query"`
	Documents []RerankDocument `json:"documents"`
	Texts     []RerankDocument `json:"texts"`
	// TopN keeps the best TopN results; 0 or absent keeps all.
	TopN *int `json:"top_n"`
	// ReturnDocuments puts each document's text in its result (default true,
	// as Jina and vLLM answer; Cohere's clients send false to leave it out).
	ReturnDocuments *bool `json:"return_documents"`
	// ReturnText is TEI's ReturnDocuments (default false).
	ReturnText bool `json:"return_text"`
	// RawScores is TEI's: false (its default) answers a model's one score through
	// a sigmoid, as TEI does; a softmax's scores (Qwen3-Reranker's) are left.
	RawScores bool `json:"raw_scores"`
	// Truncation of long documents, each client's way: vLLM's
	// truncate_prompt_tokens (a pair's tokens; -1: as many as a step takes),
	// TEI's truncate (to what a step takes) and Cohere's max_tokens_per_doc (a
	// document's own tokens, and the pair to what a step takes). Without them a
	// pair longer than a step is refused.
	TruncatePromptTokens *int  `json:"truncate_prompt_tokens"`
	Truncate             *bool `json:"truncate"`
	MaxTokensPerDoc      *int  `json:"max_tokens_per_doc"`
}

// RerankDocument is a document to rank: a JSON string or {"text": "..."}.
type RerankDocument struct {
	Text string `json:"text"`
}

// UnmarshalJSON takes a string or an object with a text.
func (d *RerankDocument) UnmarshalJSON(b []byte) error {
	if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '"' {
		return json.Unmarshal(t, &d.Text)
	}
	var o struct {
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(b, &o); err != nil || o.Text == nil {
		return errors.New("a document must be a string or an object with a text")
	}
	d.Text = *o.Text
	return nil
}

// RerankResult is one document's relevance.
type RerankResult struct {
	Index          int             `json:"index"`
	RelevanceScore float64         `json:"relevance_score"`
	Document       *RerankDocument `json:"document,omitempty"`
}

// RerankResponse is a rerank answer, its results best first.
type RerankResponse struct {
	ID      string         `json:"id"`
	Object  string         `json:"object"`
	Model   string         `json:"model"`
	Results []RerankResult `json:"results"`
	Usage   EmbeddingUsage `json:"usage"`
}

// TEIRank is one result of TEI's /rerank shape, which is a bare array.
type TEIRank struct {
	Index int     `json:"index"`
	Score float64 `json:"score"`
	Text  *string `json:"text,omitempty"`
}

// ScoreRequest is vLLM's score request: TextA against each of TextB (one text
// against many), or pairwise when both hold as many texts.
type ScoreRequest struct {
	Model string        `json:"model"`
	TextA *StringOrList `json:"text_1"`
	TextB *StringOrList `json:"text_2"`
	// TruncatePromptTokens cuts each pair's second text to fit this many tokens
	// (-1: as many as a step takes), as RerankRequest's.
	TruncatePromptTokens *int `json:"truncate_prompt_tokens"`
}

// ScoreData is one pair's score.
type ScoreData struct {
	Index  int     `json:"index"`
	Object string  `json:"object"`
	Score  float64 `json:"score"`
}

// ScoreResponse is a score answer, in the order of the pairs.
type ScoreResponse struct {
	ID      string         `json:"id"`
	Object  string         `json:"object"`
	Created int64          `json:"created"`
	Model   string         `json:"model"`
	Data    []ScoreData    `json:"data"`
	Usage   EmbeddingUsage `json:"usage"`
}

func (s *Server) rerank(c *gin.Context) {
	var req RerankRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok || !serves(c, b, cluster.TaskRerank) {
		return
	}
	tei := req.Texts != nil && req.Documents == nil
	docs := req.Documents
	if tei {
		docs = req.Texts
	}
	switch {
	case req.Query == nil:
		abort(c, invalid("query", "query is required"))
		return
	case req.Documents != nil && req.Texts != nil:
		abort(c, invalid("texts", "give documents or texts (TEI's name for them), not both"))
		return
	case len(docs) == 0:
		abort(c, invalid("documents", "documents must be a non-empty array"))
		return
	case len(docs) > maxInputs:
		abort(c, invalid("documents", "at most %d documents per request, got %d", maxInputs, len(docs)))
		return
	case req.TopN != nil && *req.TopN < 0:
		abort(c, invalid("top_n", "top_n must not be negative, got %d", *req.TopN))
		return
	}
	cut, err := truncationOf(b, req.TruncatePromptTokens, req.Truncate, req.MaxTokensPerDoc)
	if err != nil {
		abort(c, err)
		return
	}
	pairs := make([][2]string, len(docs))
	for i, d := range docs {
		pairs[i] = [2]string{*req.Query, d.Text}
	}
	scores, tokens, ok := s.scorePairs(c, b, req.Model, pairs, "query", "documents", cut)
	if !ok {
		return
	}
	order := make([]int, len(scores))
	for i := range order {
		order[i] = i
	}
	// Best first; equal scores keep the documents' order.
	slices.SortStableFunc(order, func(i, j int) int { return cmp.Compare(scores[j], scores[i]) })
	if req.TopN != nil && *req.TopN > 0 && *req.TopN < len(order) {
		order = order[:*req.TopN]
	}
	if tei {
		sigmoid := !req.RawScores && b.Info.Rerank.Scores == 1
		out := make([]TEIRank, len(order))
		for k, i := range order {
			out[k] = TEIRank{Index: i, Score: scores[i]}
			if sigmoid {
				out[k].Score = 1 / (1 + math.Exp(-scores[i]))
			}
			if req.ReturnText {
				out[k].Text = &docs[i].Text
			}
		}
		c.JSON(http.StatusOK, out)
		return
	}
	resp := RerankResponse{ID: s.newID("rerank"), Object: "list", Model: cmp.Or(req.Model, s.cfg.ModelName),
		Results: make([]RerankResult, len(order))}
	for k, i := range order {
		resp.Results[k] = RerankResult{Index: i, RelevanceScore: scores[i]}
		if req.ReturnDocuments == nil || *req.ReturnDocuments {
			resp.Results[k].Document = &docs[i]
		}
	}
	resp.Usage.PromptTokens, resp.Usage.TotalTokens = tokens, tokens
	c.JSON(http.StatusOK, resp)
}

func (s *Server) score(c *gin.Context) {
	var req ScoreRequest
	b, ok := s.decodeFor(c, &req, &req.Model)
	if !ok || !serves(c, b, cluster.TaskRerank) {
		return
	}
	var pairs [][2]string
	switch {
	case req.TextA == nil || len(*req.TextA) == 0:
		abort(c, invalid("text_1", "text_1 is required: a text, or texts as many as text_2's"))
		return
	case req.TextB == nil || len(*req.TextB) == 0:
		abort(c, invalid("text_2", "text_2 is required: a text or texts"))
		return
	case len(*req.TextA) == 1:
		for _, t := range *req.TextB {
			pairs = append(pairs, [2]string{(*req.TextA)[0], t})
		}
	case len(*req.TextA) == len(*req.TextB):
		for i, t := range *req.TextB {
			pairs = append(pairs, [2]string{(*req.TextA)[i], t})
		}
	default:
		abort(c, invalid("text_1", "text_1 holds %d texts and text_2 %d: give one text_1, or as many as text_2", len(*req.TextA), len(*req.TextB)))
		return
	}
	if len(pairs) > maxInputs {
		abort(c, invalid("text_2", "at most %d pairs per request, got %d", maxInputs, len(pairs)))
		return
	}
	cut, err := truncationOf(b, req.TruncatePromptTokens, nil, nil)
	if err != nil {
		abort(c, err)
		return
	}
	scores, tokens, ok := s.scorePairs(c, b, req.Model, pairs, "text_1", "text_2", cut)
	if !ok {
		return
	}
	resp := ScoreResponse{ID: s.newID("score"), Object: "list", Created: s.now().Unix(),
		Model: cmp.Or(req.Model, s.cfg.ModelName), Data: make([]ScoreData, len(scores))}
	for i, sc := range scores {
		resp.Data[i] = ScoreData{Index: i, Object: "score", Score: sc}
	}
	resp.Usage.PromptTokens, resp.Usage.TotalTokens = tokens, tokens
	c.JSON(http.StatusOK, resp)
}

// scorePairs computes the relevance of each (query, document) pair and counts
// their tokens; ok is false when it answered c (with an error, or forwarded to
// another node: spread); field and param name the queries' and the documents'
// fields.
func (s *Server) scorePairs(c *gin.Context, b *Backend, model string, pairs [][2]string, field, param string, cut truncation) (scores []float64, tokens int, ok bool) {
	// A query is laid out with each document: one that cannot fit a pair even
	// with an empty document is refused before it is laid out thousands of times.
	layouts := make([]*pairLayout, len(pairs))
	for i, p := range pairs {
		if i > 0 && p[0] == pairs[i-1][0] {
			layouts[i] = layouts[i-1]
			continue
		}
		l, err := newPairLayout(b, p[0])
		layouts[i] = l
		switch {
		case err != nil:
		case cut.pairTokens > 0 && len(l.empty) > cut.pairTokens:
			err = fmt.Errorf("with an empty document the pair takes %d tokens, more than the %d it is cut to", len(l.empty), cut.pairTokens)
		default:
			err = fitsOnePass(len(l.empty), b)
		}
		if err != nil {
			e := invalid(field, "%s: %v", field, err)
			if errors.Is(err, scheduler.ErrPromptTooLong) {
				s.metrics.rejected(err)
				e.Code = "context_length_exceeded"
			}
			abort(c, e)
			return nil, 0, false
		}
	}
	ctx := c.Request.Context()
	inputs := make([][]engine.Token, len(pairs))
	for i, p := range pairs {
		if ctx.Err() != nil {
			abort(c, ctx.Err())
			return nil, 0, false
		}
		toks, err := fitPair(layouts[i], p[1], cut)
		if err != nil {
			abort(c, err)
			return nil, 0, false
		}
		if len(toks) == 0 {
			abort(c, invalid(param, "%s %d: the query and document are both empty", param, i))
			return nil, 0, false
		}
		inputs[i] = toks
	}
	answered, done := s.spread(c, b, model, inputs)
	defer done()
	if answered {
		return nil, 0, false
	}
	adapter, _ := s.adapterOf(model)
	vecs, tokens, ok := s.embed(c, b, inputs, adapter, param, false)
	if !ok {
		return nil, 0, false
	}
	scores = make([]float64, len(vecs))
	for i, v := range vecs {
		if len(v) == 0 {
			abort(c, fmt.Errorf("rerank: no score for %s %d", param, i))
			return nil, 0, false
		}
		scores[i] = float64(v[0])
	}
	return scores, tokens, true
}

// plainText reports whether text tokenizes alike with and without control
// tokens parsed: it holds no control token's text.
func plainText(b *Backend, text string) (bool, error) {
	parsed, err := b.Vocab.Tokenize(text, false, true)
	if err != nil {
		return false, err
	}
	raw, err := b.Vocab.Tokenize(text, false, false)
	return slices.Equal(parsed, raw), err
}

// promptInPieces lays out the rerank prompt tmpl as llama.cpp's tokenizer lays out
// a whole text, whose control tokens cut it into runs tokenized apart, but with
// the query and document read as plain text inside their runs: each run of the
// template, its placeholders replaced, is tokenized without control tokens
// parsed, and each of the template's own control tokens stands as itself. (A
// template whose control tokens strip the whitespace beside them would keep it
// here; rerank prompts' do not.)
func promptInPieces(b *Backend, tmpl, query, doc string) ([]engine.Token, error) {
	toks, err := b.Vocab.Tokenize(tmpl, false, true)
	if err != nil {
		return nil, err
	}
	controls := map[string]engine.Token{}
	for _, t := range toks {
		plain, _ := b.Vocab.Piece(t, false)
		special, _ := b.Vocab.Piece(t, true)
		if len(plain) == 0 && len(special) > 0 {
			controls[string(special)] = t
		}
	}
	fill := strings.NewReplacer("{query}", query, "{document}", doc)
	var out []engine.Token
	run := func(text string) error {
		if text == "" {
			return nil
		}
		toks, err := b.Vocab.Tokenize(fill.Replace(text), false, false)
		out = append(out, toks...)
		return err
	}
	for tmpl != "" {
		at, which := -1, ""
		for c := range controls {
			if i := strings.Index(tmpl, c); i >= 0 && (at < 0 || i < at || i == at && len(c) > len(which)) {
				at, which = i, c
			}
		}
		if at < 0 {
			return out, run(tmpl)
		}
		if err := run(tmpl[:at]); err != nil {
			return nil, err
		}
		out = append(out, controls[which])
		tmpl = tmpl[at+len(which):]
	}
	return out, nil
}

// truncation is how a request asks long documents to be cut: to at most docTokens
// tokens of their own, and each pair to at most pairTokens; zero cuts nothing.
type truncation struct{ pairTokens, docTokens int }

// truncationOf reads the truncation fields of vLLM (pairTokens, -1: a step's
// worth), TEI (truncate) and Cohere (docTokens, with pairs cut to a step's worth).
// A pair is never cut past what one step computes.
func truncationOf(b *Backend, pairTokens *int, truncate *bool, docTokens *int) (truncation, error) {
	var t truncation
	step := stepTokens(b)
	if p := pairTokens; p != nil {
		switch {
		case *p == -1:
			t.pairTokens = step
		case *p < 1:
			return t, invalid("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (as many as fit) or at least 1, got %d", *p)
		default:
			t.pairTokens = min(*p, step)
		}
	}
	if truncate != nil && *truncate && t.pairTokens == 0 {
		t.pairTokens = step
	}
	if d := docTokens; d != nil {
		if *d < 1 {
			return t, invalid("max_tokens_per_doc", "max_tokens_per_doc must be at least 1, got %d", *d)
		}
		t.docTokens = *d
		if t.pairTokens == 0 {
			t.pairTokens = step
		}
	}
	return t, nil
}

// fitPair is l's prompt with the document cut as t asks: to its first
// docTokens tokens, then to as many as leave the pair within pairTokens (found
// by bisection; the pair is laid out again each time, so that the text is
// tokenized as it would be whole). A query too long for any document is left
// to the caller's check.
func fitPair(l *pairLayout, doc string, t truncation) ([]engine.Token, error) {
	b := l.b
	plain, err := l.plainDoc(doc) // a plain document's beginnings are plain
	if err != nil {
		return nil, err
	}
	toks, err := l.layout(doc, plain)
	if err != nil || t == (truncation{}) {
		return toks, err
	}
	over := t.pairTokens > 0 && len(toks) > t.pairTokens
	if !over && t.docTokens == 0 {
		return toks, nil
	}
	dt, err := b.Vocab.Tokenize(doc, false, false)
	if err != nil {
		return nil, err
	}
	if !over && len(dt) <= t.docTokens {
		return toks, nil
	}
	at := func(k int) ([]engine.Token, error) {
		text, err := b.Vocab.Detokenize(dt[:k], false, false)
		if err != nil {
			return nil, err
		}
		// A cut inside a character's bytes would tokenize as something else.
		return l.layout(strings.ToValidUTF8(text, ""), plain)
	}
	k := len(dt)
	if t.docTokens > 0 {
		k = min(k, t.docTokens)
	}
	if toks, err = at(k); err != nil || t.pairTokens == 0 || len(toks) <= t.pairTokens {
		return toks, err
	}
	if len(l.empty) > t.pairTokens {
		return l.empty, nil
	}
	// The document's tokens alone hardly differ in number from what they add to
	// the pair: search a few past the room the rest leaves, not the whole text.
	lo, hi := 0, min(k, t.pairTokens-len(l.empty)+8) // the pair fits at lo, not at hi
	if toks, err = at(hi); err != nil || len(toks) <= t.pairTokens {
		return toks, err
	}
	toks = l.empty
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		m, err := at(mid)
		if err != nil {
			return nil, err
		}
		if len(m) <= t.pairTokens {
			lo, toks = mid, m
		} else {
			hi = mid
		}
	}
	return toks, nil
}

// pairLayout lays out one query with documents as the reranker reads them: in its
// rerank prompt, tokenized whole with special tokens parsed, as llama-server
// tokenizes it, else between the special tokens its vocabulary adds. Unlike
// llama-server's, the placeholders are replaced in the prompt only (not in a
// query that holds "{document}"), and a text that holds a control token's text
// (a document written to close the turn and answer "yes") is tokenized as plain
// text, the prompt around it still parsed. What depends on the query alone is
// done once.
type pairLayout struct {
	b     *Backend
	query string
	plain bool           // with a rerank prompt: the query holds no control token's text
	toks  []engine.Token // without one: the query's tokens
	empty []engine.Token // the query with an empty document
}

func newPairLayout(b *Backend, query string) (*pairLayout, error) {
	l := &pairLayout{b: b, query: query}
	var err error
	if b.Info.Rerank.Template != "" {
		l.plain, err = plainText(b, query)
	} else {
		l.toks, err = b.Vocab.Tokenize(query, false, false)
	}
	if err == nil {
		l.empty, err = l.layout("", true)
	}
	return l, err
}

// prompt is the pair of l's query and doc.
func (l *pairLayout) prompt(doc string) ([]engine.Token, error) {
	plain, err := l.plainDoc(doc)
	if err != nil {
		return nil, err
	}
	return l.layout(doc, plain)
}

// plainDoc reports whether doc holds no control token's text, where it matters:
// in a rerank prompt.
func (l *pairLayout) plainDoc(doc string) (bool, error) {
	if l.b.Info.Rerank.Template == "" {
		return true, nil
	}
	return plainText(l.b, doc)
}

// layout is prompt for a document known to hold no control token's text (plain)
// or not.
func (l *pairLayout) layout(doc string, plain bool) ([]engine.Token, error) {
	b, r := l.b, l.b.Info.Rerank
	if r.Template != "" {
		if l.plain && plain {
			text := strings.NewReplacer("{query}", l.query, "{document}", doc).Replace(r.Template)
			return b.Vocab.Tokenize(text, false, true)
		}
		return promptInPieces(b, r.Template, l.query, doc)
	}
	d, err := b.Vocab.Tokenize(doc, false, false)
	if err != nil {
		return nil, err
	}
	out := make([]engine.Token, 0, len(l.toks)+len(d)+4)
	add := func(t engine.Token) {
		if t != engine.NoToken {
			out = append(out, t)
		}
	}
	add(r.BOS)
	out = append(out, l.toks...)
	add(r.EOS)
	add(r.SEP)
	out = append(out, d...)
	add(r.EOS)
	return out, nil
}
