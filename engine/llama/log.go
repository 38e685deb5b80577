package llama

/*
#include "llama.h"
#include "ggml.h"

extern void shoalLog(int level, char *text, void *user_data);

static void shoal_install_log(void) {
	llama_log_set((ggml_log_callback)shoalLog, NULL);
	ggml_log_set((ggml_log_callback)shoalLog, NULL);
}
*/
import "C"

import (
	"cmp"
	"context"
	"log/slog"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/shoal-ai/shoal/engine"
)

// llama.cpp writes its log in fragments (a line may arrive in pieces, continuation
// pieces carry GGML_LOG_LEVEL_CONT), so fragments are joined into lines here and each
// line goes to the logger. Its INFO output is a per-load report, so it is logged at
// Debug; warnings and errors keep their level.
var (
	logger    atomic.Pointer[slog.Logger]
	logMu     sync.Mutex
	logLine   strings.Builder
	logLevel  slog.Level
	lastError atomic.Value // string: llama.cpp's most recent error line, for error messages
	// loading collects the weight buffers llama.cpp reports while a model
	// loads (under logMu; nil otherwise). loadMu lets one model load at a time.
	loading *[]engine.WeightBuffer
	loadMu  sync.Mutex
	// rollingBack: a pass was aborted (aborted) and llama_decode has not yet
	// returned: its removal of the pass's cells is shoal's doing too. Under logMu.
	rollingBack bool
)

// weightBufferRE is llama.cpp's report of a buffer of weights at load.
var weightBufferRE = regexp.MustCompile(`^load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB$`)

// loadReporting runs load, a model's loading, and returns the weight buffers
// llama.cpp reported meanwhile.
func loadReporting(load func()) []engine.WeightBuffer {
	loadMu.Lock()
	defer loadMu.Unlock()
	var bufs []engine.WeightBuffer
	logMu.Lock()
	loading = &bufs
	logMu.Unlock()
	load()
	logMu.Lock()
	loading = nil
	logMu.Unlock()
	return bufs
}

func init() {
	logger.Store(slog.Default())
	C.shoal_install_log()
}

// SetLogger routes llama.cpp's and ggml's log to l (slog.Default() until called).
func SetLogger(l *slog.Logger) { logger.Store(l) }

//export shoalLog
func shoalLog(level C.int, text *C.char, _ *C.void) {
	s := C.GoString(text)
	logMu.Lock()
	defer logMu.Unlock()
	if level != C.GGML_LOG_LEVEL_CONT {
		logLevel = slogLevel(level)
	}
	logLine.WriteString(s)
	if !strings.HasSuffix(s, "\n") {
		return
	}
	line := strings.TrimSpace(logLine.String())
	logLine.Reset()
	if line == "" || strings.Trim(line, ".") == "" {
		return
	}
	if logLevel >= slog.LevelError {
		if c := capturing[threadID()]; c != nil {
			*c = line // the error of the call in progress on this thread
		} else {
			lastError.Store(line)
		}
	}
	if loading != nil {
		if m := weightBufferRE.FindStringSubmatch(line); m != nil {
			mib, _ := strconv.ParseFloat(m[2], 64)
			*loading = append(*loading, engine.WeightBuffer{Name: m[1], Bytes: uint64(mib * (1 << 20))})
		}
	}
	lv := quieted(line, logLevel, &rollingBack)
	l := logger.Load()
	if l.Enabled(context.Background(), lv) {
		l.Log(context.Background(), lv, line, "src", "llama.cpp")
	}
}

// moot reports whether a llama.cpp warning does not apply to shoal, which logs it
// at debug. "n_ctx_seq (8192) > n_ctx_train (4096)": llama.cpp counts the whole
// unified pool as one sequence's context, but the scheduler never lets a sequence
// grow past the trained context unless --max-model-len asks for it (which the
// ready line shows). A tensor quantized to a fallback type: one line per tensor,
// which llama.cpp's count of them at the end sums up.
func moot(line string) bool {
	return strings.Contains(line, "n_ctx_seq") && strings.Contains(line, "> n_ctx_train") ||
		strings.Contains(line, "are not divisible by") && strings.Contains(line, "using fallback quantization")
}

// quieted is the level line, logged by llama.cpp at lv, is logged at: debug
// for lines that do not concern shoal (moot), the errors of a pass shoal
// aborted (aborted) and, until llama_decode returns from it, the pass's
// removal of its cells; rollingBack carries that state from line to line.
func quieted(line string, lv slog.Level, rollingBack *bool) slog.Level {
	switch {
	case lv == slog.LevelError && aborted(line):
		*rollingBack = !strings.HasPrefix(line, "llama_decode:")
		return slog.LevelDebug
	case lv == slog.LevelWarn && (moot(line) || *rollingBack && strings.HasPrefix(line, "decode: removing memory module entries")):
		return slog.LevelDebug
	}
	return lv
}

// aborted reports whether a llama.cpp error says only that a pass was aborted
// (GGML_STATUS_ABORTED, llama_decode's 2): shoal's own doing, for a request
// cancelled or a server draining, which Decode reports as engine.ErrAborted.
func aborted(line string) bool {
	return strings.HasSuffix(line, "failed to compute graph, compute status: 1") ||
		strings.HasSuffix(line, "graph_compute_async failed with error 1") ||
		strings.HasSuffix(line, "failed to decode, ret = 2")
}

func slogLevel(level C.int) slog.Level {
	switch level {
	case C.GGML_LOG_LEVEL_ERROR:
		return slog.LevelError
	case C.GGML_LOG_LEVEL_WARN:
		return slog.LevelWarn
	}
	return slog.LevelDebug
}

// capturing holds, by OS thread, where the call in progress on it
// (llamaErrors) keeps the error lines llama.cpp logs on that thread; under
// logMu. Lines logged on other threads (ggml's workers) go to lastError.
var capturing = map[int]*string{}

// llamaErrors runs call, a call into llama.cpp, with this goroutine locked to
// its thread, and returns the last error line llama.cpp logged on that thread
// meanwhile, else the last one logged on any thread since the call began, else
// "". Calls running at once (a picture prepared while another is encoded) get
// their own lines, not each other's.
func llamaErrors(call func()) string {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tid := threadID()
	var line string
	logMu.Lock()
	capturing[tid] = &line
	logMu.Unlock()
	lastLlamaError()
	call()
	logMu.Lock()
	delete(capturing, tid)
	logMu.Unlock()
	return cmp.Or(line, lastLlamaError())
}

// lastLlamaError returns llama.cpp's most recent error line, or "" and clears it.
func lastLlamaError() string {
	s, _ := lastError.Swap("").(string)
	return s
}
