#pragma once
#include <stddef.h>
#include "llama.h"
#ifdef __cplusplus
extern "C" {
#endif
struct llama_sampler *shoal_grammar_init(const struct llama_vocab *vocab, const char *gbnf, const char *root);
int shoal_grammar_apply(struct llama_sampler *s, llama_token_data *data, size_t n);
int shoal_grammar_accept(struct llama_sampler *s, llama_token t);
#ifdef __cplusplus
}
#endif
