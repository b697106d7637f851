"""/v1/generate's decoding loop with and without the key-value cache: new tokens per second.

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/generate.py`` (about a minute on 2 cores with the
defaults). Options: ``--preset`` (a GPT preset: ``gpt2-tiny``, the default, or ``gpt2-small``, 124M),
``--prompt-tokens`` (16), ``--new-tokens`` (128), ``--rounds`` (3), ``--threads`` (torch threads, 1),
``--device`` (cpu). The last line is ``cached_vs_uncached: X`` (tokens/s over tokens/s).

What runs is ``jobs.serving.serve_tasks.generate_ids``, the replica's loop, greedy, with ``use_cache`` True
(``decode_step``: the prompt once, then one position per token) and False (the whole sequence again
for every token, what /v1/generate did before the cache). A random-weight model of the preset, its
``max_seq_len`` raised to prompt + new tokens where it is shorter (positions are only an embedding
table), and a stop token no model writes, so every run makes exactly ``--new-tokens`` tokens. The two
loops' tokens are checked to be the same before anything is timed.

Rounds alternate the order of the two loops; numbers are medians over rounds. The machine may be
shared: compare the ratio, not absolute numbers, across runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from ctxmodels.gpt import PRESETS, GPTForPreTraining
from jobs.serving.serve_tasks import generate_ids

NO_STOP = -1


def run(model, prompt: list[int], new_tokens: int, device, use_cache: bool) -> tuple[list[int], float]:
    """Tokens and seconds of one greedy generation."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids, finish = generate_ids("gpt", model, prompt, new_tokens, NO_STOP, 0, 0.0, None, None, 0, device, use_cache=use_cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert finish == "length" and len(ids) == new_tokens
    return ids, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2-tiny", choices=sorted(PRESETS))
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    cfg = PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, args.prompt_tokens + args.new_tokens))
    model = GPTForPreTraining(cfg, torch.Generator().manual_seed(0)).to(device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.preset} ({n_params / 1e6:.1f}M parameters, {cfg.n_layer} x {cfg.d_model}), device {device}, "
          f"{args.threads} thread(s); prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy")

    cached_ids, _ = run(model, prompt, args.new_tokens, device, use_cache=True)  # warm-up, and the same tokens both ways
    uncached_ids, _ = run(model, prompt, args.new_tokens, device, use_cache=False)
    assert cached_ids == uncached_ids, "the cached and uncached loops wrote different tokens"

    rates: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for use_cache in ((True, False) if r % 2 == 0 else (False, True)):
            _, seconds = run(model, prompt, args.new_tokens, device, use_cache)
            rates[use_cache].append(args.new_tokens / seconds)
            print(f"round {r}: {'cached  ' if use_cache else 'uncached'} {args.new_tokens / seconds:9.1f} tokens/s")
    cached, uncached = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"cached: {cached:.1f} tokens/s")
    print(f"uncached: {uncached:.1f} tokens/s")
    print(f"cached_vs_uncached: {cached / uncached:.2f}")


if __name__ == "__main__":
    main()
