package cluster

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/shoal-ai/shoal/kvcache"
)

// Every gossip payload starts with a version byte (as serf does), and messages with a
// kind byte after it, so that nodes of different versions can tell what they got.
const (
	wireVersion byte = 1

	msgLoad    byte = 1 // a node's load, self-replacing
	msgPrefix  byte = 2 // block hashes a node added to its cache since its last delta
	stateFull  byte = 3 // push/pull: every node's summary this node knows of its own
	msgEvict   byte = 4 // block hashes a node evicted since its last delta
	maxMetaLen      = 512
)

// Meta is what a node advertises in memberlist's node metadata (≤ 512 bytes).
type Meta struct {
	HTTP   string   `json:"h"` // host:port of the node's API
	Models []string `json:"m"` // served model ids: the model's, then its LoRA adapters'
	// Aliases are other ids the model (Models[0]) answers to.
	Aliases  []string `json:"a,omitempty"`
	Capacity int      `json:"c"`           // max running sequences
	Draining bool     `json:"d,omitempty"` // refuses new work
	TLS      bool     `json:"t,omitempty"` // API served over TLS
	// Leaving is set just before a graceful leave, so that peers record "left" and not
	// "dead" (memberlist's leave event does not say which).
	Leaving bool `json:"l,omitempty"`
	// Simulated marks a node running engine/sim: its answers are not a model's.
	Simulated bool `json:"s,omitempty"`
	// Device names where the model runs, e.g. "CUDA0 NVIDIA H200 (140 GiB)" or "CPU".
	Device string `json:"g,omitempty"`
	// MaxModelLen is the longest sequence one request may have there (0: unknown,
	// a node of an earlier release).
	MaxModelLen int `json:"x,omitempty"`
	// MaxTokensCap is the most output tokens one request may ask for there
	// (--max-tokens-cap; 0: only the context bounds it).
	MaxTokensCap int `json:"o,omitempty"`
	// Blocks fingerprints how the node hashes prompt blocks (--hash-seed,
	// --block-tokens; set by New): nodes that hash them otherwise cannot be
	// matched against each other's caches, which a peer logs.
	Blocks uint32 `json:"b,omitempty"`
	// Keys: the node requires API keys of its clients, so the requests it
	// forwards were checked against them (peers take those on its credential).
	Keys bool `json:"k,omitempty"`
	// Task is what the node computes with its models: TaskGenerate (a node of
	// an earlier release too), TaskEmbed or TaskRerank. One model file served
	// both ways advertises one id twice: a request is routed to a node of its
	// task.
	Task string `json:"w,omitempty"`
	// Vision: the node reads images with its generation model (a projector):
	// requests with images go to such nodes (TaskVision).
	Vision bool `json:"i,omitempty"`
}

// serves reports whether a request naming model may go to the node: one of
// its models, or an alias of its first.
func (m *Meta) serves(model string) bool {
	return slices.Contains(m.Models, model) || slices.Contains(m.Aliases, model)
}

// Tasks a node serves its models for (Meta.Task), and a request's (Route).
const (
	TaskGenerate = ""
	TaskEmbed    = "embed"
	TaskRerank   = "rerank"
	// TaskAny is a request any node serving the model answers (tokenizing).
	TaskAny = "any"
	// TaskVision is a generation request with images, which nodes of
	// TaskGenerate with Vision answer.
	TaskVision = "vision"
)

// does reports whether a node of m computes a request of task.
func (m Meta) does(task string) bool {
	switch task {
	case TaskAny:
		return true
	case TaskVision:
		return m.Task == TaskGenerate && m.Vision
	}
	return m.Task == task
}

func encodeMeta(m Meta) ([]byte, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	b = append([]byte{wireVersion}, b...)
	if len(b) > maxMetaLen {
		return nil, fmt.Errorf("cluster: node metadata of %d bytes exceeds %d (too many or too long model ids: the model's, its other names' and its LoRA adapters' are gossiped in it)", len(b), maxMetaLen)
	}
	return b, nil
}

func decodeMeta(b []byte) (Meta, error) {
	var m Meta
	if len(b) == 0 || b[0] != wireVersion {
		return m, errors.New("cluster: metadata of an unknown version")
	}
	if err := json.Unmarshal(b[1:], &m); err != nil {
		return m, fmt.Errorf("cluster: metadata: %w", err)
	}
	if m.HTTP == "" || m.Capacity < 0 {
		return m, errors.New("cluster: metadata without an HTTP address")
	}
	return m, nil
}

// Load is the part of a node's scheduler state that routing needs.
type Load struct {
	Waiting       int     `json:"waiting"`
	Running       int     `json:"running"`
	KVUsed        float64 `json:"kv_used"` // fraction of KV blocks in use
	PrefillTPS    float64 `json:"prefill_tps"`
	DecodeTPS     float64 `json:"decode_tps"`
	QueueWaitMS   float64 `json:"queue_wait_ms"`
	MaxWaiting    int     `json:"max_waiting"`
	SummaryBlocks int     `json:"summary_blocks"`
	BlockTokens   int     `json:"block_tokens"`
	PendingTokens int     `json:"pending_tokens"` // prompt tokens it still has to prefill
	Seq           uint64  `json:"seq"`            // increases with every update from the node
	// FinishPS is how many sequences leave its running batch per second of work:
	// with every slot taken, a queued request waits for finishes, not for prefill.
	FinishPS float64 `json:"finish_ps"`
	// Boot identifies the node's process (its start, in Unix nanoseconds): Seq starts
	// again with a new process under the same name, and a later Boot means a
	// restart, whose cache starts empty.
	Boot uint64 `json:"boot"`
}

// loadMsg is a load update on the wire: header, node name, then fixed-width fields.
func encodeLoad(node string, l Load) []byte {
	b := []byte{wireVersion, msgLoad, byte(len(node))}
	b = append(b, node...)
	u := func(v uint64) { b = binary.LittleEndian.AppendUint64(b, v) }
	f := func(v float64) { u(math.Float64bits(v)) }
	u(uint64(l.Waiting))
	u(uint64(l.Running))
	f(l.KVUsed)
	f(l.PrefillTPS)
	f(l.DecodeTPS)
	f(l.QueueWaitMS)
	u(uint64(l.MaxWaiting))
	u(uint64(l.SummaryBlocks))
	u(uint64(l.BlockTokens))
	u(uint64(l.PendingTokens))
	u(l.Seq)
	f(l.FinishPS)
	u(l.Boot)
	return b
}

// minLoadFields is how many fields a load message carries at least (encodeLoad writes
// 13); a decoder reads the fields it knows, leaves those a node of an older release
// does not send at zero, and ignores those a newer one appends.
const minLoadFields = 11

// maxLoadValue bounds a load message's rates and waits (a wait of 1e12 ms is 30
// years).
const maxLoadValue = 1e12

func decodeLoad(b []byte) (string, Load, error) {
	var l Load
	if len(b) < 3 || b[0] != wireVersion || b[1] != msgLoad {
		return "", l, errors.New("cluster: not a load message")
	}
	n := int(b[2])
	if len(b) < 3+n+8*minLoadFields || (len(b)-3-n)%8 != 0 {
		return "", l, fmt.Errorf("cluster: load message of %d bytes", len(b))
	}
	node := string(b[3 : 3+n])
	r := b[3+n:]
	fields := len(r) / 8
	u := func() uint64 { v := binary.LittleEndian.Uint64(r); r = r[8:]; return v }
	f := func() float64 { return math.Float64frombits(u()) }
	in := func() int { return int(min(u(), math.MaxInt32)) }
	l.Waiting, l.Running = in(), in()
	l.KVUsed, l.PrefillTPS, l.DecodeTPS, l.QueueWaitMS = f(), f(), f(), f()
	l.MaxWaiting, l.SummaryBlocks, l.BlockTokens, l.PendingTokens = in(), in(), in(), in()
	l.Seq = u()
	if fields >= 12 { // FinishPS, the twelfth
		l.FinishPS = f()
	}
	if fields >= 13 { // Boot
		l.Boot = u()
	}
	for _, x := range []float64{l.KVUsed, l.PrefillTPS, l.DecodeTPS, l.QueueWaitMS, l.FinishPS} {
		// Beyond maxLoadValue a number is no measurement (and a wait in
		// milliseconds that large would overflow a time.Duration).
		if math.IsNaN(x) || math.IsInf(x, 0) || x < 0 || x > maxLoadValue {
			return "", l, errors.New("cluster: load message with an invalid number")
		}
	}
	return node, l, nil
}

// encodeHashes is a message of block hashes of node at summary generation gen; kind
// says what they are: msgPrefix (added since the last delta), msgEvict (evicted
// since the last delta) or stateFull (push/pull: the node's own full summary; each
// node speaks for itself, and memberlist pairs nodes often enough that every pair
// converges).
func encodeHashes(kind byte, node string, gen uint64, hs []kvcache.Hash) []byte {
	b := []byte{wireVersion, kind, byte(len(node))}
	b = append(b, node...)
	b = binary.LittleEndian.AppendUint64(b, gen)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(hs)))
	for _, h := range hs {
		b = binary.LittleEndian.AppendUint64(b, uint64(h))
	}
	return b
}

// maxSummary bounds the hashes kept per node (and so push/pull state and memory):
// the most recently added ones win.
const maxSummary = 1 << 16

// decodeHashes reads a message encodeHashes wrote with the same kind.
func decodeHashes(kind byte, b []byte) (string, uint64, []kvcache.Hash, error) {
	if len(b) < 3 || b[0] != wireVersion || b[1] != kind {
		return "", 0, nil, fmt.Errorf("cluster: not a hash message of kind %d", kind)
	}
	n := int(b[2])
	if len(b) < 3+n+12 {
		return "", 0, nil, errors.New("cluster: short hash message")
	}
	node := string(b[3 : 3+n])
	r := b[3+n:]
	gen := binary.LittleEndian.Uint64(r)
	cnt := int(binary.LittleEndian.Uint32(r[8:]))
	r = r[12:]
	if cnt > maxSummary || len(r) != 8*cnt {
		return "", 0, nil, fmt.Errorf("cluster: hash message claims %d hashes in %d bytes", cnt, len(r))
	}
	hs := make([]kvcache.Hash, cnt)
	for i := range hs {
		hs[i] = kvcache.Hash(binary.LittleEndian.Uint64(r[8*i:]))
	}
	return node, gen, hs, nil
}
