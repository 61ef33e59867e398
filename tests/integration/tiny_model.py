"""Make a tiny random-weight Llama (and a word-level tokenizer) on disk, for offline vLLM tests.

Real random weights (std 0.02 init, fixed seed) make greedy outputs depend on the KV cache, so a P/D run
that moved wrong bytes diverges from the single-instance reference. No network access is needed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 1024
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def words() -> list[str]:
    """The tokenizer's vocabulary (special tokens, then w4..w1023)."""
    return SPECIAL + [f"w{i}" for i in range(len(SPECIAL), VOCAB)]


def make_tiny_llama(path: str | Path, *, seed: int = 0, layers: int = 2, sliding_window: int | None = None) -> Path:
    """Write config, weights and tokenizer to ``path`` (idempotent: skips when config.json exists).

    ``sliding_window``: every other layer attends to that many tokens only (``layer_types``, as Gemma 2 or
    GPT-OSS do; vLLM's Llama reads them), so vLLM's hybrid allocator makes two KV cache groups."""
    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, torch_dtype="float32",
    )
    if sliding_window is not None:
        cfg.layer_types = ["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2)
        cfg.sliding_window = sliding_window
    model = LlamaForCausalLM(cfg)
    model.to(torch.float32).save_pretrained(out)
    vocab = {w: i for i, w in enumerate(words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    # a minimal chat template so /v1/chat/completions works
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)
    gen = out / "generation_config.json"
    if gen.exists():  # keep sampling defaults neutral
        data = json.loads(gen.read_text())
        data.pop("temperature", None)
        gen.write_text(json.dumps(data))
    return out


if __name__ == "__main__":
    print(make_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
