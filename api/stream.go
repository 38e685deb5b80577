package api

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/scheduler"
)

// sseWriter writes server-sent events in OpenAI's format: "data: <json>\n\n", ending
// with "data: [DONE]\n\n". Writes after the client left are dropped.
type sseWriter struct {
	c      *gin.Context
	mu     sync.Mutex
	failed bool
}

func (w *sseWriter) start() {
	h := w.c.Writer.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	h.Set("X-Accel-Buffering", "no")
	w.c.Status(http.StatusOK)
	w.c.Writer.WriteHeaderNow()
}

func (w *sseWriter) data(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	w.raw(b)
}

// event writes a named event, as Anthropic's stream has them: "event:
// <name>\ndata: <json>\n\n".
func (w *sseWriter) event(name string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	w.write("event: "+name+"\n", b)
}

func (w *sseWriter) raw(b []byte) { w.write("", b) }

// comment writes an SSE comment, which clients skip: a sign of life.
func (w *sseWriter) comment(text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.failed {
		return
	}
	if _, err := w.c.Writer.Write([]byte(": " + text + "\n\n")); err != nil {
		w.failed = true
		return
	}
	w.c.Writer.Flush()
}

// keepAlive calls alive every every, until the function it returns is
// called, which returns once alive no longer runs (the handler's writer is not
// touched after it returns). Events between do not delay it: a tick is cheap.
func (w *sseWriter) keepAlive(every time.Duration, alive func()) (stop func()) {
	t := time.NewTicker(every)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-done:
				return
			case <-t.C:
				alive()
			}
		}
	})
	return func() { t.Stop(); close(done); wg.Wait() }
}

// write writes one event: head, then b as its data.
func (w *sseWriter) write(head string, b []byte) {
	buf := make([]byte, 0, len(head)+len(b)+8)
	w.send(append(append(append(append(buf, head...), "data: "...), b...), "\n\n"...))
}

// send writes buf and flushes it, unless a write failed before.
func (w *sseWriter) send(buf []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.failed {
		return
	}
	if _, err := w.c.Writer.Write(buf); err != nil {
		w.failed = true
		return
	}
	w.c.Writer.Flush()
}

// streamResponse streams every choice of every prompt as chunks. Prompts are read
// one after another; the scheduler buffers the others meanwhile.
func (s *Server) streamResponse(c *gin.Context, b *Backend, p *plan, subs []submitted) {
	ctx := c.Request.Context()
	w := &sseWriter{c: c}
	w.start()
	id := s.newID("chatcmpl")
	object := "chat.completion.chunk"
	if !p.chat {
		id, object = s.newID("cmpl"), "text_completion"
	}
	created := s.now().Unix()
	var usage Usage
	var nullUsage *Usage // OpenAI sends "usage": null on every chunk when include_usage is set
	var sofar Usage      // continuous_usage_stats: the prompts begun and the tokens generated so far
	chunkUsage := func() *Usage {
		if p.continuousUsage {
			u := sofar
			u.TotalTokens = u.PromptTokens + u.CompletionTokens
			return &u
		}
		if p.usage {
			return nullUsage
		}
		return nil
	}
	// Per choice, the next token's text_offset: offsets count the tokens'
	// names, as the whole answer's (CompletionLogprobs.add).
	offsets := map[int]int{}
	sendCompletion := func(ch CompletionChoice) {
		w.data(completionChunkJSON{CompletionResponse: CompletionResponse{ID: id, Object: object, Created: created, Model: p.model,
			SystemFingerprint: fingerprint, Choices: []CompletionChoice{ch}}, includeUsage: p.usage, usage: chunkUsage()})
	}
	chunk := func(ch ChatChunkChoice) {
		w.data(chatChunkJSON{ChatChunk: ChatChunk{ID: id, Object: object, Created: created, Model: p.model, SystemFingerprint: fingerprint,
			Choices: []ChatChunkChoice{ch}}, includeUsage: p.usage, usage: chunkUsage()})
	}
	send := func(index int, text *string, finish *string, lp *TokenLogprob, role string, stop any) {
		if p.chat {
			ch := ChatChunkChoice{Index: index, Delta: ChatDelta{Role: role, Content: text}, FinishReason: finish, StopReason: stop}
			if lp != nil {
				ch.Logprobs = &ChatLogprobs{Content: []TokenLogprob{*lp}}
			}
			chunk(ch)
			return
		}
		t := ""
		if text != nil {
			t = *text
		}
		ch := CompletionChoice{Index: index, Text: t, FinishReason: finish, StopReason: stop}
		if lp != nil {
			ch.Logprobs = newLegacyLogprobs()
			ch.Logprobs.add([]TokenLogprob{*lp}, offsets[index])
			offsets[index] += utf8.RuneCountInString(lp.Token)
		}
		sendCompletion(ch)
	}
	// A chat choice's output may hold thoughts, passed on apart, and, under
	// tools, calls, passed on once whole (and under the tool protocol the
	// answer's text is decoded from JSON as it comes).
	outputs := map[int]*choiceOutput{}
	output := func(idx int) *choiceOutput {
		o, ok := outputs[idx]
		if !ok {
			o = p.newOutput()
			outputs[idx] = o
		}
		return o
	}
	follow := func(sub submitted, ev scheduler.Event) (reasoning, text string) {
		if o := output(sub.base + ev.Index); o != nil {
			return o.follow(sub.stream, ev)
		}
		return "", ev.Text
	}
	think := func(idx int, reasoning string) {
		if reasoning != "" {
			chunk(ChatChunkChoice{Index: idx, Delta: ChatDelta{ReasoningContent: &reasoning}})
		}
	}
	for pi, sub := range subs {
		sofar.PromptTokens += sub.prompt
		for j := range p.n {
			idx := sub.base + j
			switch {
			case p.chat:
				empty := ""
				send(idx, &empty, nil, nil, "assistant", nil)
			case pi < len(p.echo) && !p.echoScores: // with its scores once they come
				e := p.echo[pi]
				send(idx, &e, nil, nil, "", nil)
			}
		}
		u, err := s.drain(ctx, b, p, sub, func(ev scheduler.Event) {
			idx := sub.base + ev.Index
			if p.warm && ev.Kind != scheduler.EventPromptLogprobs {
				// max_tokens 0: the token drawn is not the answer's.
				if ev.Kind == scheduler.EventFinish {
					f := "length"
					send(idx, nil, &f, nil, "", nil)
				}
				return
			}
			switch ev.Kind {
			case scheduler.EventPromptLogprobs:
				for j := range p.n {
					ch := CompletionChoice{Index: sub.base + j, Text: p.echo[pi], Logprobs: newLegacyLogprobs()}
					offsets[ch.Index] = ch.Logprobs.addPrompt(p, b.Vocab, p.prompts[pi], ev.Prompt, p.top)
					sendCompletion(ch)
				}
			case scheduler.EventToken:
				sofar.CompletionTokens++
				reasoning, text := follow(sub, ev)
				think(idx, reasoning)
				var lp *TokenLogprob
				if o := output(idx); p.logprobs && (o == nil || !o.cutByStop()) {
					l := p.tokenLogprob(b.Vocab, ev)
					lp = &l
				}
				if text != "" || lp != nil {
					send(idx, &text, nil, lp, "", nil)
				}
				if o := output(idx); o != nil {
					if d := o.callProgress(s.newCallID); len(d) > 0 {
						chunk(ChatChunkChoice{Index: idx, Delta: ChatDelta{ToolCalls: d}})
					}
				}
			case scheduler.EventFinish:
				reasoning, t := follow(sub, ev)
				think(idx, reasoning)
				f, stop := finishString(ev.Finish), stopReason(ev)
				var calls []ToolCallDelta
				if o := output(idx); o != nil {
					var rest string
					var whole []ToolCall
					rest, whole, f = o.end(s.newCallID, f)
					calls = o.callRest(whole)
					t += rest
					stop = outputStop(o, stop, f)
				}
				if t != "" {
					send(idx, &t, nil, nil, "", nil)
				}
				if len(calls) > 0 {
					chunk(ChatChunkChoice{Index: idx, Delta: ChatDelta{ToolCalls: calls}})
				}
				send(idx, nil, &f, nil, "", stop)
			}
		})
		if err != nil {
			if ctx.Err() != nil {
				return // the client left; its requests were cancelled with ctx
			}
			// Headers are sent: report the error as an event, as OpenAI does.
			w.data(toAPIError(err).body())
			w.raw([]byte("[DONE]"))
			return
		}
		addUsage(&usage, u)
	}
	if p.usage {
		if p.chat {
			w.data(ChatChunk{ID: id, Object: object, Created: created, Model: p.model, SystemFingerprint: fingerprint,
				Choices: []ChatChunkChoice{}, Usage: &usage})
		} else {
			w.data(CompletionResponse{ID: id, Object: object, Created: created, Model: p.model, SystemFingerprint: fingerprint,
				Choices: []CompletionChoice{}, Usage: &usage})
		}
	}
	w.raw([]byte("[DONE]"))
}

// chatChunkJSON marshals a chunk with "usage": null when include_usage is set.
type chatChunkJSON struct {
	ChatChunk
	includeUsage bool
	usage        *Usage
}

func (c chatChunkJSON) MarshalJSON() ([]byte, error) {
	if !c.includeUsage {
		return json.Marshal(c.ChatChunk)
	}
	type withUsage struct {
		ChatChunk
		Usage *Usage `json:"usage"`
	}
	return json.Marshal(withUsage{ChatChunk: c.ChatChunk, Usage: c.usage})
}

type completionChunkJSON struct {
	CompletionResponse
	includeUsage bool
	usage        *Usage
}

func (c completionChunkJSON) MarshalJSON() ([]byte, error) {
	if !c.includeUsage {
		return json.Marshal(c.CompletionResponse)
	}
	type withUsage struct {
		CompletionResponse
		Usage *Usage `json:"usage"`
	}
	return json.Marshal(withUsage{CompletionResponse: c.CompletionResponse, Usage: c.usage})
}
