package api

import (
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/shoal-ai/shoal/engine/enginetest"
	"github.com/shoal-ai/shoal/engine/sample"
)

// TestLlamaSamplerDefaults: a request's llama-server samplers get
// llama-server's defaults for what it leaves out, and a backend lays each list
// of DRY sequence breakers over its vocabulary once.
func TestLlamaSamplerDefaults(t *testing.T) {
	b := &Backend{Vocab: enginetest.New(64, 4, 64).Vocab(), dry: &dryBreakers{}}
	mult, on := 0.8, 2
	var sp sample.Params
	if err := b.llamaSamplers(&LlamaSamplerFields{DryMultiplier: &mult, Mirostat: &on}, &sp); err != nil {
		t.Fatal(err)
	}
	want := sample.Params{TopNSigma: -1, TypicalP: 1, XTCThreshold: 0.1, DynatempExponent: 1, Mirostat: 2, MirostatTau: 5, MirostatEta: 0.1,
		DRY: sample.DRY{Multiplier: 0.8, Base: 1.75, AllowedLength: 2, LastN: -1, Breakers: sp.DRY.Breakers}}
	if sp.DRY.Breakers == nil {
		t.Fatal("DRY on without sequence breakers")
	}
	if got, _ := json.Marshal(sp); string(got) != string(must(json.Marshal(want))) {
		t.Errorf("got %s, want %s", got, must(json.Marshal(want)))
	}
	var again sample.Params
	if err := b.llamaSamplers(&LlamaSamplerFields{DryMultiplier: &mult}, &again); err != nil || again.DRY.Breakers != sp.DRY.Breakers {
		t.Errorf("the default breakers were laid out again (%v)", err)
	}
	var off sample.Params
	if err := b.llamaSamplers(&LlamaSamplerFields{}, &off); err != nil || off.DRY.Breakers != nil {
		t.Errorf("DRY off: breakers %v (%v)", off.DRY.Breakers, err)
	}

	// The backend's defaults (serve's flags) come before llama-server's, and
	// a request's fields before them.
	half, zero := 0.5, 0.0
	b.LlamaSampling = LlamaSamplerFields{DryMultiplier: &half, DrySequenceBreakers: []string{}}
	var def sample.Params
	if err := b.llamaSamplers(&LlamaSamplerFields{}, &def); err != nil || def.DRY.Multiplier != 0.5 || def.DRY.Breakers != nil || def.DRY.Base != 1.75 {
		t.Errorf("the backend's DRY without breakers: %+v (%v)", def.DRY, err)
	}
	var asked sample.Params
	if err := b.llamaSamplers(&LlamaSamplerFields{DryMultiplier: &zero}, &asked); err != nil || asked.DRY.Multiplier != 0 {
		t.Errorf("a request turning DRY off: %+v (%v)", asked.DRY, err)
	}
	if err := (&Backend{LlamaSampling: LlamaSamplerFields{Mirostat: new(3)}}).CheckLlamaSamplers(); err == nil {
		t.Error("mirostat 3 as a default was accepted")
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestLlamaSamplersReachTheSampler: XTC sent to /completion and to
// /v1/completions changes what is drawn. At temperature 2 every token of the
// fake model is at least 0.4% likely, so XTC at probability 1 leaves only the
// least likely: the last of the equals, token 63 ("i"), or token 62 ("h") when
// the model favours 63.
func TestLlamaSamplersReachTheSampler(t *testing.T) {
	s := newTestServer(t, nil)
	for _, path := range []string{"/completion", "/v1/completions"} {
		body := `{"prompt":"abc","max_tokens":24,"n_predict":24,"temperature":2,"seed":1,"xtc_probability":1,"xtc_threshold":0.004}`
		w := s.do(t, "POST", path, body)
		if w.Code != 200 {
			t.Fatalf("%s: %d %s", path, w.Code, w.Body)
		}
		if text := completionText(t, w.Body.Bytes()); strings.Trim(text, "hi") != "" || len(text) != 24 {
			t.Errorf("%s with XTC: %q, want 24 of h and i", path, text)
		}
		w = s.do(t, "POST", path, strings.Replace(body, `"xtc_probability":1`, `"xtc_probability":0`, 1))
		if text := completionText(t, w.Body.Bytes()); w.Code != 200 || strings.Trim(text, "hi") == "" {
			t.Errorf("%s without XTC: %d %q", path, w.Code, text)
		}
	}
}

// completionText is the text of /completion's or /v1/completions' answer.
func completionText(t *testing.T, body []byte) string {
	t.Helper()
	var r struct {
		Content string `json:"content"`
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	if len(r.Choices) > 0 {
		return r.Choices[0].Text
	}
	return r.Content
}

// TestLlamaSamplersAsLlamaServerTakesThem: values llama-server takes are taken
// with its meanings: typical_p 0 keeps the most typical token, dry_base below
// 1 turns DRY off, an empty breaker is left out, any xtc_threshold above 0.5
// turns XTC off; and lists of breakers are told apart however their strings
// are made (laid out at once by many requests).
func TestLlamaSamplersAsLlamaServerTakesThem(t *testing.T) {
	b := &Backend{Vocab: enginetest.New(64, 4, 64).Vocab(), dry: &dryBreakers{}}
	zero, half, two, mult := 0.0, 0.5, 2.0, 0.8
	var sp sample.Params
	if err := b.llamaSamplers(&LlamaSamplerFields{TypicalP: &zero, XTCThreshold: &two, DryMultiplier: &mult, DryBase: &half}, &sp); err != nil {
		t.Fatal(err)
	}
	if sp.TypicalP <= 0 || sp.TypicalP > 1e-30 || sp.XTCThreshold != 2 || sp.DRY.Multiplier != 0 {
		t.Errorf("typical_p %v, xtc_threshold %v, DRY %+v", sp.TypicalP, sp.XTCThreshold, sp.DRY)
	}
	var wg sync.WaitGroup
	got := make([]*sample.Breakers, 8)
	for i := range got {
		wg.Go(func() {
			list := []string{"a\x00b"}
			if i%2 == 1 {
				list = []string{"a", "b", ""}
			}
			var p sample.Params
			if err := b.llamaSamplers(&LlamaSamplerFields{DryMultiplier: &mult, DrySequenceBreakers: list}, &p); err != nil {
				t.Error(err)
			}
			got[i] = p.DRY.Breakers
		})
	}
	wg.Wait()
	for i := range got {
		if got[i] == nil || got[i] != got[i%2] || got[0] == got[1] {
			t.Fatalf("breakers %d: %p; want %p", i, got[i], got[i%2])
		}
	}
}

// TestSamplerOrder: llama-server's "samplers", as names or letters, names it
// does not know left out; and a request's order decides what runs: XTC
// listed runs, XTC left out does not (with temperature left out: 1).
func TestSamplerOrder(t *testing.T) {
	for raw, want := range map[string][]sample.Stage{
		`"edkt"`: {sample.StagePenalties, sample.StageDRY, sample.StageTopK, sample.StageTemperature},
		// Requests name samplers as llama-server's do: canonical names only
		// ("typical_p", "temp" are its command line's), "infill" known and
		// left out.
		`["penalties","dry","top_n_sigma","top_k","typ_p","tfs_z","typical_p","top_p","min_p","xtc","temp","temperature","infill"]`: {
			sample.StagePenalties, sample.StageDRY, sample.StageTopNSigma, sample.StageTopK, sample.StageTypicalP, sample.StageTopP,
			sample.StageMinP, sample.StageXTC, sample.StageTemperature},
		`"kpit"`: {sample.StageTopK, sample.StageTopP, sample.StageTemperature},
		`[]`:     {},
	} {
		got, err := SamplerOrder(json.RawMessage(raw))
		if err != nil || !slices.Equal(got, want) || got == nil {
			t.Errorf("%s: %v %v, want %v", raw, got, err, want)
		}
	}
	if _, err := SamplersFlag("top_k;tmperature"); err == nil {
		t.Error("--samplers with a misspelt name was accepted")
	}
	if raw, err := SamplersFlag("top-k;nucleus;infill;temp"); err != nil || string(raw) != `["top_k","top_p","temperature"]` {
		t.Errorf("--samplers with the command line's names: %s %v", raw, err)
	}
	s := newTestServer(t, nil)
	if w := s.do(t, "POST", "/completion", `{"prompt":"a","samplers":3}`); w.Code != 400 || !strings.Contains(w.Body.String(), `"param":"samplers"`) {
		t.Errorf("samplers 3: %d %s", w.Code, w.Body)
	}
	body := `{"prompt":"abc","n_predict":24,"seed":1,"xtc_probability":1,"xtc_threshold":0.00004,"samplers":["xtc"]}`
	if text := completionText(t, s.do(t, "POST", "/completion", body).Body.Bytes()); strings.Trim(text, "hi") != "" || len(text) != 24 {
		t.Errorf("XTC listed: %q, want 24 of h and i", text)
	}
	body = strings.Replace(body, `["xtc"]`, `["top_k"]`, 1)
	if text := completionText(t, s.do(t, "POST", "/completion", body).Body.Bytes()); strings.Trim(text, "hi") == "" {
		t.Errorf("XTC left out: %q", text)
	}
}
