"""What a request's first output costs vLLM's API server in detokenization, with and without
:mod:`kvtransport_vllm.primer`, by prompt length and tokenizer (runs anywhere vLLM imports; no engine, no GPU).

For each tokenizer and prompt length: vLLM's own ``FastIncrementalDetokenizer`` is built for a request, then its
first ``decode_next`` is timed (what the first output pays); "primed" builds it for a P/D request inside an event
loop, lets the loop run the priming (timed too: off the answer path, during the request's wait), then times the
first ``decode_next``. Medians of ``--reps`` (alternating plain and primed). Tokenizers, all of 128,256 tokens:
``serving`` (the serving benchmark's WordLevel, no decoder), ``wordpiece`` (WordLevel + WordPiece decoder),
``bytelevel`` (WordLevel over byte-level symbols + ByteLevel decoder, the kind Llama 3 and GPT-2 use).

    python benchmarks/detok_prime.py [--lengths 256,2048,8192] [--reps 9] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

VOCAB = 128256
PD_PARAMS = {"do_remote_prefill": True, "kvt_xfer": "bench", "remote_host": "127.0.0.1", "remote_port": 5000}


def tokenizer(kind: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if kind == "bytelevel":
        symbols = list(pre_tokenizers.ByteLevel.alphabet())
        vocab = {f"{symbols[i % len(symbols)]}{symbols[(i // len(symbols)) % len(symbols)]}{i}": i
                 for i in range(VOCAB)}
    else:
        vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=next(iter(vocab))))
    if kind == "wordpiece":
        tok.decoder = decoders.WordPiece()
    elif kind == "bytelevel":
        tok.decoder = decoders.ByteLevel()
    return tok


def measure(kind: str, lengths: list[int], reps: int) -> list[dict[str, Any]]:
    from kvtransport_vllm import primer
    from tokenizers.decoders import DecodeStream
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    primer.install()
    tok = tokenizer(kind)
    wrapper = SimpleNamespace(_tokenizer=tok)
    rows = []
    for n in lengths:
        prompt = [random.Random(n).randrange(VOCAB) for _ in range(n)]
        next_id = prompt[0]

        def request(params: dict[str, Any] | None, prompt: list[int] = prompt) -> Any:
            extra = {"kv_transfer_params": params} if params else None
            return SimpleNamespace(request_id="r", prompt_token_ids=prompt, prompt_embeds=None,
                                   sampling_params=SamplingParams(max_tokens=2, extra_args=extra))

        def plain(next_id: int = next_id) -> float:
            det = FastIncrementalDetokenizer(wrapper, request(None))
            t0 = time.perf_counter()
            det.decode_next(next_id)
            return time.perf_counter() - t0

        async def primed(next_id: int = next_id, prompt: list[int] = prompt) -> tuple[float, float]:
            det = FastIncrementalDetokenizer(wrapper, request(PD_PARAMS))
            await asyncio.sleep(2 * primer.PRIME_AFTER_S)  # the loop runs the priming the constructor scheduled
            t0 = time.perf_counter()
            det.decode_next(next_id)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()  # what the priming itself costs (off the answer path)
            primer.primed_stream(DecodeStream, tok, prompt, True)
            return first, time.perf_counter() - t0

        plain_s, primed_s, prime_s = [], [], []
        for _ in range(reps):
            plain_s.append(plain())
            first, priming = asyncio.run(primed())
            primed_s.append(first)
            prime_s.append(priming)
        row = {"tokenizer": kind, "prompt_tokens": n,
               "first_output_ms_plain": round(1000 * statistics.median(plain_s), 4),
               "first_output_ms_primed": round(1000 * statistics.median(primed_s), 4),
               "priming_ms_off_path": round(1000 * statistics.median(prime_s), 4)}
        row["saved_ms"] = round(row["first_output_ms_plain"] - row["first_output_ms_primed"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,2048,8192")
    ap.add_argument("--tokenizers", default="serving,wordpiece,bytelevel")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import vllm

    lengths = [int(x) for x in a.lengths.split(",")]
    rows = [r for kind in a.tokenizers.split(",") for r in measure(kind, lengths, a.reps)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.processor() or platform.machine(),
              "python": sys.version.split()[0], "vllm": vllm.__version__, "reps": a.reps, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
