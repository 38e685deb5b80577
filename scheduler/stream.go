package scheduler

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shoal-ai/shoal/engine"
)

// EventKind says what an Event carries.
type EventKind uint8

const (
	// EventToken: one generated token of choice Index, with the text it completes
	// (possibly empty while a UTF-8 rune or a possible stop string is held back).
	EventToken EventKind = iota
	// EventFinish: choice Index ended with Finish; Text is any text held back until now.
	EventFinish
	// EventDone: the last event of a stream that succeeded, with the usage of all choices.
	EventDone
	// EventError: the last event of a stream that failed; Err says why.
	EventError
	// EventEmbedding: the pooled embedding of an Embed request, in Vector.
	EventEmbedding
	// EventPromptLogprobs: the scores of a PromptLogprobs request's prompt
	// tokens after the first, in Prompt; once, before any token of choice 0.
	EventPromptLogprobs
)

// FinishReason is why a choice ended, in OpenAI's words where they exist.
type FinishReason string

const (
	FinishStop      FinishReason = "stop"      // end-of-generation token or a stop string
	FinishLength    FinishReason = "length"    // max_tokens or the context is full
	FinishCancelled FinishReason = "cancelled" // the request's context ended
)

// Usage counts tokens of a request.
type Usage struct {
	PromptTokens     int
	CachedTokens     int // prompt tokens served from the prefix cache
	CompletionTokens int
	// QueueTime is how long the request waited before it was first scheduled.
	QueueTime time.Duration
	// MaxTokens bounds each choice's generated tokens: the request's
	// max_tokens, the configured default, or without either the room the
	// longest context leaves after the prompt (vLLM's default max_tokens).
	MaxTokens int
}

// Event is one item of a Stream.
type Event struct {
	Kind    EventKind
	Index   int
	Token   engine.Token
	Text    string
	Logprob float32            // when the request asked for logprobs
	Top     []engine.TokenProb // top alternatives, when asked for
	Finish  FinishReason
	// StopString, or Token when ByStopToken, ended the choice (EventFinish;
	// vLLM's stop_reason).
	StopString  string
	ByStopToken bool
	// EndOfGeneration: the token (EventToken) is the end-of-generation token
	// that ends its choice: listed with its logprobs, it has no text of its
	// own (Text is what was held back before it).
	EndOfGeneration bool
	Usage           Usage
	Err             error
	Vector          []float32
	Prompt          []engine.TokenScore // EventPromptLogprobs: Prompt[i] scores prompt token i+1
	// At is when the scheduler produced the event: latency metrics read it, not the
	// time a reader (busy with another choice, or a slow client) got to it.
	At time.Time
	// Step is the forward pass that produced a token (Load.Steps then): a
	// sequence's accepted proposals share its decode row's, so that latency
	// between tokens is measured once per step, as vLLM does.
	Step uint64
}

// Stream delivers a request's events in order. The scheduler appends without ever
// blocking; the buffer grows as needed (bounded by the request's max_tokens).
//
// Concurrency: one reader goroutine calls Next and Stop; the scheduler goroutine
// writes.
type Stream struct {
	mu     sync.Mutex
	buf    []Event
	closed bool
	notify chan struct{} // capacity 1: "something changed"
	done   chan struct{} // closed after the final event was appended
	// stop holds the choices the reader asked to end (Stop, Cut) and how;
	// stopAsked says whether there are any, so that the scheduler's check costs
	// one load.
	stop      map[int]FinishReason
	stopAsked atomic.Bool
	wake      func() // the scheduler's, to act on Stop while it waits
	// cached and queued are the request's Usage.CachedTokens and QueueTime,
	// set when it is first scheduled (Started), for a reader that leaves
	// before EventDone.
	cached, queued atomic.Int64
}

// Started reports the prompt tokens the request took from the prefix cache
// and how long it waited to be scheduled, once it has been (else 0, 0). Any
// goroutine.
func (s *Stream) Started() (cached int, queued time.Duration) {
	return int(s.cached.Load()), time.Duration(s.queued.Load())
}

func newStream(wake func()) *Stream {
	return &Stream{notify: make(chan struct{}, 1), done: make(chan struct{}), wake: wake}
}

// Stop asks the scheduler to end choice index as a stop string would
// (FinishStop, its KV freed) within one step: for a reader that matches stop
// strings in text the scheduler does not see, such as an answer inside JSON.
// Its finish event follows as usual; a choice that has ended is unaffected.
func (s *Stream) Stop(index int) { s.end(index, FinishStop) }

// Cut asks the scheduler to end choice index as max_tokens would
// (FinishLength) within one step: the text it held back (the possible start of
// a stop string, a character's first bytes) comes with the finish, for a
// reader that ends a choice at a limit of its own, such as a time.
func (s *Stream) Cut(index int) { s.end(index, FinishLength) }

func (s *Stream) end(index int, reason FinishReason) {
	s.mu.Lock()
	if s.stop == nil {
		s.stop = map[int]FinishReason{}
	}
	if _, asked := s.stop[index]; !asked {
		s.stop[index] = reason
	}
	s.mu.Unlock()
	s.stopAsked.Store(true)
	if s.wake != nil {
		s.wake()
	}
}

// stopped reports whether the reader asked to end choice index, and how.
func (s *Stream) stopped(index int) (FinishReason, bool) {
	if !s.stopAsked.Load() {
		return "", false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.stop[index]
	return r, ok
}

func (s *Stream) push(ev Event) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	if ev.At.IsZero() {
		ev.At = time.Now()
	}
	s.buf = append(s.buf, ev)
	final := ev.Kind == EventDone || ev.Kind == EventError
	if final {
		s.closed = true
	}
	s.mu.Unlock()
	select {
	case s.notify <- struct{}{}:
	default:
	}
	if final {
		close(s.done)
	}
}

// Next returns the next event, waiting for one. ok is false when the stream has
// ended and every event was read, or when ctx ended first.
func (s *Stream) Next(ctx context.Context) (ev Event, ok bool) {
	for {
		s.mu.Lock()
		if len(s.buf) > 0 {
			ev = s.buf[0]
			s.buf[0] = Event{}
			s.buf = s.buf[1:]
			s.mu.Unlock()
			return ev, true
		}
		closed := s.closed
		s.mu.Unlock()
		if closed {
			return Event{}, false
		}
		select {
		case <-s.notify:
		case <-ctx.Done():
			return Event{}, false
		}
	}
}

// Done is closed once the final event (EventDone or EventError) has been queued.
func (s *Stream) Done() <-chan struct{} { return s.done }
