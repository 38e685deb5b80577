package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/enginetest"
)

// TestRerankPrompt: a query and a document are laid out in the model's rerank
// prompt, whose placeholders alone are replaced (a query holding "{document}"
// stays as written), or between the special tokens the vocabulary adds.
func TestRerankPrompt(t *testing.T) {
	v := enginetest.New(256, 4, 64).Vocab()
	tok := func(s string) []engine.Token {
		out, _ := v.Tokenize(s, false, false)
		return out
	}
	b := &Backend{Vocab: v, Info: engine.ModelInfo{Rerank: &engine.RerankLayout{Template: "q:{query} d:{document}"}}}
	rerankPrompt := func(b *Backend, query, doc string) ([]engine.Token, error) {
		l, err := newPairLayout(b, query)
		if err != nil {
			return nil, err
		}
		return l.prompt(doc)
	}
	got, err := rerankPrompt(b, "{document}", "xy")
	if want := tok("q:{document} d:xy"); err != nil || !slices.Equal(got, want) {
		t.Fatalf("in the rerank prompt: %v, want %v (%v)", got, want, err)
	}
	b.Info.Rerank = &engine.RerankLayout{BOS: 1, EOS: 2, SEP: engine.NoToken}
	got, _ = rerankPrompt(b, "ab", "c")
	if want := slices.Concat([]engine.Token{1}, tok("ab"), []engine.Token{2}, tok("c"), []engine.Token{2}); !slices.Equal(got, want) {
		t.Fatalf("between special tokens: %v, want %v", got, want)
	}
	b.Info.Rerank = &engine.RerankLayout{BOS: engine.NoToken, EOS: engine.NoToken, SEP: engine.NoToken}
	if got, _ = rerankPrompt(b, "", ""); len(got) != 0 {
		t.Fatalf("two empty texts without special tokens: %v", got)
	}
}

// TestRerankDecoding: documents are strings or objects with a text; score's texts
// a string or strings.
func TestRerankDecoding(t *testing.T) {
	var r RerankRequest
	if err := json.Unmarshal([]byte(`{"query":"q","documents":["a",{"text":"b","title":"t"}," c"]}`), &r); err != nil ||
		len(r.Documents) != 3 || r.Documents[1].Text != "b" || r.Documents[2].Text != " c" {
		t.Fatalf("documents: %+v %v", r.Documents, err)
	}
	for _, bad := range []string{`[3]`, `[{"title":"t"}]`, `[null]`, `[["a"]]`} {
		if err := json.Unmarshal([]byte(`{"documents":`+bad+`}`), &r); err == nil {
			t.Errorf("documents %s accepted", bad)
		}
	}
	var s ScoreRequest
	if err := json.Unmarshal([]byte(`{"text_1":"a","text_2":["b","c"]}`), &s); err != nil ||
		!slices.Equal(*s.TextA, StringOrList{"a"}) || !slices.Equal(*s.TextB, StringOrList{"b", "c"}) {
		t.Fatalf("score texts: %+v %v", s, err)
	}
	if err := json.Unmarshal([]byte(`{"text_1":3}`), &s); err == nil {
		t.Error("a number as text_1 accepted")
	}
}

// TestRerankShapes: rerank answers best first with top_n, the documents unless
// asked not to, TEI's bare array for texts, and score in the pairs' order, with
// the same scores; a node that is no reranker refuses both.
func TestRerankShapes(t *testing.T) {
	s := newRerankServer(t)
	w := s.do(t, "POST", "/v1/rerank", `{"model":"fake","query":"q","documents":["a","bb",{"text":"ccc"},"dddd"],"top_n":3}`)
	var rr RerankResponse
	if err := json.Unmarshal(w.Body.Bytes(), &rr); err != nil || w.Code != 200 || rr.ID != "rerank-test" || len(rr.Results) != 3 || rr.Usage.PromptTokens == 0 {
		t.Fatalf("rerank: %d %s", w.Code, w.Body)
	}
	docs := []string{"a", "bb", "ccc", "dddd"}
	for k, r := range rr.Results {
		if r.Document == nil || r.Document.Text != docs[r.Index] || k > 0 && r.RelevanceScore > rr.Results[k-1].RelevanceScore {
			t.Fatalf("result %d: %+v", k, r)
		}
	}
	w = s.do(t, "POST", "/v1/score", `{"text_1":"q","text_2":["a","bb","ccc","dddd"]}`)
	var sc ScoreResponse
	if err := json.Unmarshal(w.Body.Bytes(), &sc); err != nil || w.Code != 200 || len(sc.Data) != 4 {
		t.Fatalf("score: %d %s", w.Code, w.Body)
	}
	for _, r := range rr.Results {
		if sc.Data[r.Index].Score != r.RelevanceScore {
			t.Fatalf("pair %d: rerank %v, score %v", r.Index, r.RelevanceScore, sc.Data[r.Index].Score)
		}
	}
	w = s.do(t, "POST", "/v1/score", `{"text_1":["a","b"],"text_2":["c","d"]}`)
	if err := json.Unmarshal(w.Body.Bytes(), &sc); err != nil || w.Code != 200 || len(sc.Data) != 2 || sc.Data[1].Index != 1 {
		t.Fatalf("pairwise score: %d %s", w.Code, w.Body)
	}
	w = s.do(t, "POST", "/rerank", `{"query":"q","texts":["a","b"]}`)
	var tei []TEIRank
	if err := json.Unmarshal(w.Body.Bytes(), &tei); err != nil || w.Code != 200 || len(tei) != 2 || tei[0].Text != nil {
		t.Fatalf("TEI: %d %s", w.Code, w.Body)
	}
	w = s.do(t, "POST", "/v2/rerank", `{"query":"q","documents":["a"],"return_documents":false}`)
	if w.Code != 200 || bytes.Contains(w.Body.Bytes(), []byte(`"document"`)) {
		t.Fatalf("return_documents false: %d %s", w.Code, w.Body)
	}
	g := newTestServer(t, nil)
	for _, path := range []string{"/v1/rerank", "/v1/score"} {
		if w := g.do(t, "POST", path, `{"query":"q","documents":["a"],"text_1":"q","text_2":"a"}`); w.Code != 400 || !bytes.Contains(w.Body.Bytes(), []byte("--reranking")) {
			t.Errorf("%s on a generation node: %d %s", path, w.Code, w.Body)
		}
	}
}

// newRerankServer is a test server whose fake engine is a reranker.
func newRerankServer(t testing.TB) *testServer {
	s := newTestServer(t, nil)
	s.fake.Rerank = &engine.RerankLayout{BOS: 1, EOS: 2, SEP: engine.NoToken, Scores: 1}
	b := *s.backend.Load()
	b.Info = s.fake.Info()
	s.SetBackend(&b)
	return s
}

// FuzzRerankRequests: no body makes rerank or score fail with a 5xx or an error
// outside OpenAI's format.
func FuzzRerankRequests(f *testing.F) {
	fuzzOpenAIErrors(f, newRerankServer(f), "/v1/rerank", "/v1/score",
		`{"query":"q","documents":["a",{"text":"b"}],"top_n":1}`, `{"query":"","texts":["","x"],"return_text":true}`,
		`{"text_1":["a","b"],"text_2":["c","d"]}`, `{"text_1":"a","text_2":"b"}`, `{"query":"q","documents":[3]}`,
		`null`, `[]`, `{"documents":null,"query":null}`)
}

// TestRerankTruncation: each client's way of asking long documents to be cut
// cuts them (the fake's tokens are one per letter), and only what a step takes.
func TestRerankTruncation(t *testing.T) {
	s := newRerankServer(t)
	long := strings.Repeat("x", 3000) // over the fake's step budget of 512
	usage := func(body string) (int, string) {
		w := s.do(t, "POST", "/v1/rerank", body)
		var rr RerankResponse
		_ = json.Unmarshal(w.Body.Bytes(), &rr)
		return rr.Usage.PromptTokens, fmt.Sprint(w.Code, " ", w.Body.String())
	}
	// [BOS] q [EOS] doc [EOS]: 4 tokens besides the document's.
	for _, c := range []struct {
		body string
		want int
	}{
		{`{"query":"q","documents":["` + long + `"],"truncate_prompt_tokens":-1}`, 512},
		{`{"query":"q","documents":["` + long + `"],"truncate_prompt_tokens":100}`, 100},
		{`{"query":"q","documents":["` + long + `"],"truncate":true}`, 512},
		{`{"query":"q","documents":["` + long + `","abc"],"max_tokens_per_doc":5}`, 9 + 7},
		{`{"query":"q","documents":["abc"],"truncate_prompt_tokens":100}`, 7},
	} {
		if got, answer := usage(c.body); got != c.want {
			t.Errorf("%.80s…: %d tokens, want %d (%.200s)", c.body, got, c.want, answer)
		}
	}
	for _, bad := range []string{
		`{"query":"q","documents":["` + long + `"]}`,
		`{"query":"q","documents":["a"],"truncate_prompt_tokens":0}`,
		`{"query":"q","documents":["a"],"max_tokens_per_doc":0}`,
		`{"query":"` + long + `","documents":["a"],"truncate":true}`,
	} {
		if w := s.do(t, "POST", "/v1/rerank", bad); w.Code != 400 {
			t.Errorf("%.80s…: %d %s", bad, w.Code, w.Body)
		}
	}
	// Too long, the document and the query alike: context_length_exceeded,
	// counted as too_long.
	tooLong := s.metrics.rejects.WithLabelValues("too_long")
	before := testutil.ToFloat64(tooLong)
	for _, bad := range []string{`{"query":"q","documents":["` + long + `"]}`, `{"query":"` + long + `","documents":["a"]}`} {
		if w := s.do(t, "POST", "/v1/rerank", bad); w.Code != 400 || !strings.Contains(w.Body.String(), "context_length_exceeded") {
			t.Errorf("%.80s…: %d %s", bad, w.Code, w.Body)
		}
	}
	if got := testutil.ToFloat64(tooLong) - before; got != 2 {
		t.Errorf("%v too-long inputs counted, want 2", got)
	}
	// A query that leaves no room for any document is the query's fault, not the
	// documents': within the cut asked for, or within a step.
	for _, bad := range []string{
		`{"query":"` + strings.Repeat("q", 50) + `","documents":["abcdefgh","zz"],"truncate_prompt_tokens":20}`,
		`{"query":"` + strings.Repeat("q", 510) + `","documents":["a"],"truncate":true}`,
	} {
		if w := s.do(t, "POST", "/v1/rerank", bad); w.Code != 400 || !bytes.Contains(w.Body.Bytes(), []byte(`"param":"query"`)) {
			t.Errorf("%.80s…: %d %s", bad, w.Code, w.Body)
		}
	}
	if w := s.do(t, "POST", "/v1/score", `{"text_1":"q","text_2":"`+long+`","truncate_prompt_tokens":-1}`); w.Code != 200 {
		t.Errorf("score with truncation: %d %s", w.Code, w.Body)
	}
}

// controlVocab is the fake's vocabulary with one control token, "<c>" (id 60),
// which Tokenize parses only when asked to and Piece shows only as special.
type controlVocab struct{ engine.Vocab }

func (v controlVocab) Tokenize(s string, add, parse bool) ([]engine.Token, error) {
	if !parse {
		return v.Vocab.Tokenize(s, add, false)
	}
	var out []engine.Token
	for i, part := range strings.Split(s, "<c>") {
		if i > 0 {
			out = append(out, 60)
		}
		toks, _ := v.Vocab.Tokenize(part, add && i == 0, false)
		out = append(out, toks...)
	}
	return out, nil
}

func (v controlVocab) Piece(t engine.Token, special bool) ([]byte, error) {
	if t == 60 {
		if special {
			return []byte("<c>"), nil
		}
		return nil, nil
	}
	return v.Vocab.Piece(t, special)
}

// TestRerankControlText: a document holding a control token's text is read as
// plain text inside the rerank prompt, whose own control tokens stay; a plain
// one is tokenized as the whole prompt is.
func TestRerankControlText(t *testing.T) {
	v := controlVocab{enginetest.New(256, 4, 64).Vocab()}
	b := &Backend{Vocab: v, Info: engine.ModelInfo{Rerank: &engine.RerankLayout{Template: "<c>Q:{query}<c>D:{document}<c>"}}}
	plainTok := func(s string) []engine.Token { out, _ := v.Tokenize(s, false, false); return out }
	l, err := newPairLayout(b, "x")
	if err != nil {
		t.Fatal(err)
	}
	got, _ := l.prompt("y<c>yes")
	want := slices.Concat([]engine.Token{60}, plainTok("Q:x"), []engine.Token{60}, plainTok("D:y<c>yes"), []engine.Token{60})
	if !slices.Equal(got, want) {
		t.Fatalf("a document with control text: %v, want %v", got, want)
	}
	whole, _ := v.Tokenize("<c>Q:x<c>D:yy<c>", false, true)
	if pieces, _ := promptInPieces(b, b.Info.Rerank.Template, "x", "yy"); !slices.Equal(pieces, whole) {
		t.Fatalf("plain texts in pieces: %v, whole: %v", pieces, whole)
	}
}
