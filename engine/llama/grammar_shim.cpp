// C wrappers around llama.cpp's grammar sampler that turn C++ exceptions (thrown, for
// example, when a token the grammar forbids is accepted) into error returns instead of
// letting them cross into Go, which would terminate the process.
#include "llama.h"
#include "grammar_shim.h"

extern "C" {

struct llama_sampler *shoal_grammar_init(const struct llama_vocab *vocab, const char *gbnf, const char *root) {
	try {
		return llama_sampler_init_grammar(vocab, gbnf, root);
	} catch (...) {
		return nullptr;
	}
}

int shoal_grammar_apply(struct llama_sampler *s, llama_token_data *data, size_t n) {
	try {
		llama_token_data_array arr = {data, n, -1, false};
		llama_sampler_apply(s, &arr);
		return 0;
	} catch (...) {
		return -1;
	}
}

int shoal_grammar_accept(struct llama_sampler *s, llama_token t) {
	try {
		llama_sampler_accept(s, t);
		return 0;
	} catch (...) {
		return -1;
	}
}

}
