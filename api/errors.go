package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// Error is an API error with its HTTP status and OpenAI error fields.
type Error struct {
	Status  int
	Type    string
	Code    string
	Param   string
	Message string
	// RetryAfter, when positive, is sent as the Retry-After header (seconds).
	RetryAfter int
}

func (e *Error) Error() string { return e.Message }

func invalid(param, format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: param, Message: fmt.Sprintf(format, args...)}
}

// StatusClientClosed is the status a request is logged and counted with when
// its client hung up before its answer: nginx's 499, outside the 5xx.
const StatusClientClosed = 499

// Errors callers of the package may see in responses.
var (
	errUnauthorized = &Error{Status: http.StatusUnauthorized, Type: "authentication_error", Code: "invalid_api_key",
		Message: "missing or invalid API key: send Authorization: Bearer <key> (or x-api-key: <key>)"}
	errNotReady = &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", Code: "not_ready",
		Message: "the model is still loading", RetryAfter: 1}
	errDraining = &Error{Status: http.StatusServiceUnavailable, Type: "service_unavailable", Code: "draining",
		Message: "the node is shutting down", RetryAfter: 1}
)

// toAPIError maps any error to the API error that describes it: the one place where
// errors become HTTP status codes.
func toAPIError(err error) *Error {
	var ae *Error
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &mbe):
		return &Error{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error", Code: "request_too_large",
			Message: fmt.Sprintf("request body exceeds %d bytes", mbe.Limit)}
	case errors.Is(err, scheduler.ErrQueueFull):
		return &Error{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "queue_full",
			Message: "the server is at capacity: the waiting queue is full", RetryAfter: 1}
	case errors.Is(err, scheduler.ErrPromptTooLong):
		return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded", Param: "messages", Message: err.Error()}
	case errors.Is(err, scheduler.ErrInvalid), errors.Is(err, engine.ErrInvalidInput):
		return &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: err.Error()}
	case errors.Is(err, scheduler.ErrClosed):
		return errDraining
	case errors.Is(err, context.DeadlineExceeded):
		return &Error{Status: http.StatusGatewayTimeout, Type: "timeout", Message: "the request timed out"}
	}
	return &Error{Status: http.StatusInternalServerError, Type: "server_error", Message: err.Error()}
}

// renamed is e with the chat fields it names, as its field and in its
// message, under the names a translated request gives them (params):
// "temperature must be ..." as "options.temperature must be ..." for Ollama.
func (e *Error) renamed(params map[string]string) *Error {
	out := *e
	if p, ok := params[e.Param]; ok {
		out.Param = p
	}
	for from, to := range params {
		out.Message = renameWord(out.Message, from, to)
	}
	return &out
}

// renameWord is s with each whole word from (not part of a longer name, nor
// after a dot: "top_p", not "options.top_p" or "top_p_x") replaced by to.
func renameWord(s, from, to string) string {
	nameChar := func(b byte) bool {
		return b == '_' || b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9'
	}
	var out strings.Builder
	done := 0 // s[:done] is written
	for at := 0; ; {
		i := strings.Index(s[at:], from)
		if i < 0 {
			out.WriteString(s[done:])
			return out.String()
		}
		i += at
		at = i + len(from)
		if (i == 0 || !nameChar(s[i-1]) && s[i-1] != '.') && (at == len(s) || !nameChar(s[at])) {
			out.WriteString(s[done:i])
			out.WriteString(to)
			done = at
		}
	}
}

func (e *Error) body() ErrorBody {
	d := ErrorDetail{Message: e.Message, Type: e.Type}
	if e.Param != "" {
		d.Param = &e.Param
	}
	if e.Code != "" {
		d.Code = &e.Code
	}
	return ErrorBody{Error: d}
}
