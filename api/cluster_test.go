package api

import (
	"net/http/httptest"
	"testing"

	"github.com/gin-gonic/gin"
)

// TestStreamFailureFormats: a stream relayed from a peer that fails mid-way
// ends in its API's own format: Anthropic's and the Responses API's clients
// act on named events only.
func TestStreamFailureFormats(t *testing.T) {
	for path, want := range map[string]string{
		"/v1/messages":         "event: error\ndata: {\"error\":{\"message\":\"peer p failed mid-stream\",\"type\":\"api_error\"},\"type\":\"error\"}\n\n",
		"/v1/responses":        "event: error\ndata: {\"code\":\"peer_failed\",\"message\":\"peer p failed mid-stream\",\"param\":null,\"type\":\"error\"}\n\n",
		"/v1/chat/completions": "",
	} {
		c, _ := gin.CreateTestContext(httptest.NewRecorder())
		c.Request = httptest.NewRequest("POST", path, nil)
		if path == "/v1/messages" {
			c.Set(anthropicKey, true)
		}
		f := streamFailure(c)
		switch {
		case want == "" && f != nil:
			t.Errorf("%s: %q, want the forwarder's OpenAI default", path, f("peer_failed", "peer p failed mid-stream"))
		case want != "" && (f == nil || f("peer_failed", "peer p failed mid-stream") != want):
			t.Errorf("%s: got a different end, want %q", path, want)
		}
	}
}
