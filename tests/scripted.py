"""A real transformers model whose next token is a fixed function of the current one, for tests that need a
policy to call tools on cue: one Qwen2 layer whose attention and MLP write nothing (o_proj, down_proj = 0), so
the final hidden state is the current token's embedding (one-hot, after RMSNorm sqrt(H) e_t), and an LM head
whose column t puts a logit of MARGIN on successor(t) and 0 on the rest, so that sampling at temperature 1 picks it
with probability 1 - V e^-MARGIN (~1 - 1e-8), yet its log-prob still has a gradient (1 - p is not 0 in float32)."""
from __future__ import annotations

import torch

from grpo.tasks.calculator import CHATML_TOOLS
from grpo.tasks.tiny import train_tokenizer, tiny_qwen2

CALL = '{"name":"multiply","arguments":{"a":3,"b":4}}'
MARGIN = 25.0
UNKNOWN_CALL = '{"name":"divide","arguments":{"a":3,"b":4}}'
TEXTS = ["What is 3 times 4?", "The answer is 12.", "<tool_response>\n12\n</tool_response>", "Compute 3*4: <<3*4=12>>",
         "assistant user system tool error"]


def scripted_tokenizer(*words: str):
    """The tools tests' tokenizer: byte-level BPE trained on TEXTS, `words` (and the Hermes tags) added whole,
    ChatML with tools (grpo.tasks.calculator.CHATML_TOOLS)."""
    tokenizer = train_tokenizer(TEXTS * 5, vocab_size=300)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", *words])
    tokenizer.chat_template = CHATML_TOOLS
    return tokenizer


def scripted_model(tokenizer, successor: dict[int, int]):
    """A Qwen2 model sampling successor[t] after token t (EOS after any other token)."""
    V = len(tokenizer)
    H = (V + 63) // 64 * 64
    model = tiny_qwen2(V, hidden_size=H, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       tie_word_embeddings=False)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(V, H))
        head = torch.zeros(V, H)
        for t in range(V):
            head[successor.get(t, tokenizer.eos_token_id), t] = MARGIN / H ** 0.5
        model.lm_head.weight.copy_(head)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id, cfg.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return model


def chain(tokenizer, start: str, *pieces: str) -> dict[int, int]:
    """The successor map of a script: after the last token of `start`, the tokens of `pieces` in order (each
    token once in the script), then EOS."""
    ids = [tokenizer.encode(start, add_special_tokens=False)[-1]]
    for piece in pieces:
        ids += tokenizer.encode(piece, add_special_tokens=False)
    assert len(set(ids)) == len(ids), f"a token repeats in the script {ids}: its successor would be ambiguous"
    return dict(zip(ids, ids[1:] + [tokenizer.eos_token_id]))
