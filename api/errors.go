package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"

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
