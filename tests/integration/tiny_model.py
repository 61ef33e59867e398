"""Make a tiny random-weight Llama (and a byte-level BPE tokenizer) on disk, for offline vLLM tests.

Real random weights (std 0.02 init, fixed seed) make greedy outputs depend on the KV cache, so a P/D run
that moved wrong bytes diverges from the single-instance reference. No network access is needed.

The tokenizer is byte-level, as GPT-2's and Llama 3's are: every byte has a token of its own (``byte_token``),
so a character of several UTF-8 bytes can be split across tokens (the text then depends on the tokens before
it), and the words ``w4`` ... ``w1023`` (with or without a leading space) are one token each, so a prompt of
``n`` such words is ``n`` tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORDS = 1024
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
BYTES_AT = len(SPECIAL)
"""The token of byte ``b`` is ``BYTES_AT + b``."""


def byte_token(b: int) -> int:
    return BYTES_AT + b


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (what byte-level BPE vocabularies are written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Special tokens, the 256 byte tokens (in byte order), then ``w4`` ... ``w1023`` and ``Ġw4`` ... (``Ġ``: a
    leading space) built by merges one character at a time (their prefixes ``w1``, ``Ġw10`` ... are tokens too)."""
    b2u = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for b in range(256):
        vocab[b2u[b]] = byte_token(b)
    merges: list[tuple[str, str]] = []
    for lead in (b2u[ord(" ")], ""):  # the spaced words first: their merges must rank before "w" + digit
        for i in range(len(SPECIAL), WORDS):
            word = lead + f"w{i}"
            for cut in range(2, len(word) + 1):
                left, right, whole = word[:cut - 1], word[cut - 1], word[:cut]
                if whole not in vocab:
                    vocab[whole] = len(vocab)
                    merges.append((left, right))
    return vocab, merges


def vocab_size() -> int:
    return len(vocabulary()[0])


def _save_tokenizer(out: Path) -> None:
    """The byte-level BPE tokenizer of this module, with a minimal chat template, saved beside a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = vocabulary()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
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


def make_tiny_mla(path: str | Path, *, seed: int = 0, layers: int = 2) -> Path:
    """A tiny random-weight DeepSeek-V2-shaped model (multi-head latent attention, dense MLPs) and the byte-level
    tokenizer, written to ``path`` (idempotent).

    Its KV cache is MLA's: one latent vector per token (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576, the
    size vLLM's CPU MLA kernel is built for), a 3-D ``[num_blocks, block_size, 576]`` tensor per layer with no K/V
    split and no heads; every tensor-parallel rank holds all of it. The MLPs are dense (``first_k_dense_replace``
    = ``layers``) so no MoE kernel is needed."""
    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=vocab_size(), hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=layers, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, torch_dtype="float32",
    )
    model = DeepseekV2ForCausalLM(cfg)
    model.to(torch.float32).save_pretrained(out)
    _save_tokenizer(out)
    return out


def make_tiny_llama(path: str | Path, *, seed: int = 0, layers: int = 2, sliding_window: int | None = None) -> Path:
    """Write config, weights and tokenizer to ``path`` (idempotent: skips when config.json exists).

    ``sliding_window``: every other layer attends to that many tokens only (``layer_types``, as Gemma 2 or
    GPT-OSS do; vLLM's Llama reads them), so vLLM's hybrid allocator makes two KV cache groups."""
    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size(), hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, torch_dtype="float32",
    )
    if sliding_window is not None:
        cfg.layer_types = ["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2)
        cfg.sliding_window = sliding_window
    model = LlamaForCausalLM(cfg)
    model.to(torch.float32).save_pretrained(out)
    _save_tokenizer(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "mla":
        print(make_tiny_mla(sys.argv[1]))
    else:
        print(make_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
