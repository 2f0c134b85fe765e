"""A tiny random gpt-oss on a harmony tokenizer: the default model's tokenizer with harmony's special
tokens added and gpt-oss's real chat template (tests/server/gpt_oss_chat_template.jinja, as the model
ships it), stopping on `<|return|>` and `<|call|>` as gpt-oss does.

Its replies open with an analysis that ends after one token: nothing in the layers writes to channel 0
of the residual stream, which every embedding row holds large and positive, and only the head's rows of
`<|end|>` and of the first token of "analysis" read it. Under the tools' grammar a reply is then an
analysis of one token and a call (or a final answer).
"""

import os
from pathlib import Path
from typing import Any

import torch

from kvserve.config import default_cache_dir
from kvserve.model.loader import tokenizer_dir
from tests.helpers import save_tiny_model

TEMPLATE = Path(__file__).with_name("gpt_oss_chat_template.jinja")
SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def harmony_tokenizer() -> Any:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir(None, default_cache_dir()))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def save_harmony_gpt_oss(path: str) -> str:
    import transformers

    tokenizer = harmony_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    save_tiny_model(
        path,
        "gpt_oss",
        vocab_size=len(tokenizer),
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        intermediate_size=64,
        sliding_window=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=[ids["<|return|>"], ids["<|call|>"]],
        bos_token_id=None,
        pad_token_id=ids["<|end|>"],
    )
    model = transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        inner = model.model
        inner.embed_tokens.weight[:, 0] = 4.0
        inner.norm.weight[0] = 1.0
        for layer in inner.layers:
            layer.input_layernorm.weight[0] = 0.0
            layer.post_attention_layernorm.weight[0] = 0.0
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.self_attn.o_proj.bias[0] = 0.0
            layer.mlp.experts.down_proj[:, :, 0] = 0.0
            layer.mlp.experts.down_proj_bias[:, 0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[ids["<|end|>"], 0] = 60.0
        # And where the grammar lets the reply choose its first channel, analysis.
        model.lm_head.weight[tokenizer.encode("analysis", add_special_tokens=False)[0], 0] = 40.0
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            os.remove(os.path.join(path, name))
    tokenizer.save_pretrained(path)
    return path
