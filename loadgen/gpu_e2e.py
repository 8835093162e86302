"""The served stack on a GPU against transformers, one part of `make gpu-check`:

    python -m pagedserve.loadgen.gpu_e2e --json OUT [--device cuda] [--model DIR]

1. A random-weight 1B-shaped Llama is built (16 layers, hidden 2048, 32 query / 8 KV heads of 64,
   MLP 8192; the locally trained 2k-token tokenizer), unless --model names one.
2. float32: the served stack (kvstore, worker, scheduler, router; the pool sized by
   --gpu-memory-utilization, so the profile hand-over runs) answers greedy completions equal to
   transformers' greedy decoding on the GPU, token for token.
3. bfloat16: the offline engine scores transformers' greedy continuations (prompt logprobs, teacher
   forcing); its top-1 equals transformers' bf16 top-1 at >= 99 % of the positions where that
   top-1 is decisive (DECISIVE_NATS; the share over all positions is reported beside it); the
   logprob differences of the scored tokens are reported.
4. Pressure: a second float32 stack with a small device pool and swap preemption gives the first
   stack's results for greedy, n=4 seeded sampling and beam search 4 sent all at once, and it did
   preempt (so swaps went through the pinned host pool and the copy streams).
5. Replay: Poisson arrivals at a few rates against the first stack, through loadgen's client:
   output tok/s, TTFT and TPOT as vllm bench serve defines them.

Every check is a row {section, check, ok, figure}; the JSON file holds them all. ok=None marks a
figure that is reported, not judged. --device cpu with a small --layers/--hidden runs the same
code on CPU (a smoke run of this script, not a check of the GPU).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
import urllib.request
from pathlib import Path

import torch

from pagedserve.loadgen.bench_e2e import drive, make_requests
from pagedserve.loadgen.metrics import summarize
from pagedserve.loadgen.stack import Stack

NEW_TOKENS = 24
AGREEMENT = 0.99
# A random-weight model's logits are nearly flat, so two correct bf16 implementations disagree at
# near-ties: the gate counts the positions where transformers' own top-1 leads by this much.
DECISIVE_NATS = 0.1


def build_model(out: Path, device: str, layers: int, hidden: int) -> str:
    from pagedserve.services.tiny_model import build_tiny_model
    if (out / "config.json").exists():
        return str(out)
    heads = max(4, hidden // 64)
    overrides = {"num_hidden_layers": layers, "intermediate_size": 4 * hidden, "num_attention_heads": heads,
                 "num_key_value_heads": heads // 4, "head_dim": hidden // heads}
    build_tiny_model(out, arch="llama", seed=0, max_len=4096, hidden_size=hidden, overrides=overrides,
                     device=device)
    return str(out)


def prompts_for(vocab: int, lens=(5, 37, 130, 300)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lens]


def hf_model(model: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], n: int, device: str) -> list[int]:
    """Plain argmax decoding with transformers' own KV cache (EOS is a token like any other, as
    with ignore_eos on our side)."""
    x = torch.tensor([prompt], device=device)
    out = hf(x, use_cache=True)
    tokens = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = hf(torch.tensor([[nxt]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_scores(hf, seq: list[int], device: str) -> tuple[list[int], list[float], list[float]]:
    """Teacher forcing over seq -> per position 0..len-2: (top-1 id, logprob of the actual next
    token, top-1 minus top-2 logprob)."""
    logprobs = torch.log_softmax(hf(torch.tensor([seq], device=device)).logits[0].float(), dim=-1)[:-1]
    nxt = torch.tensor(seq[1:], device=device)
    top2 = logprobs.topk(2, dim=-1).values
    return (logprobs.argmax(-1).tolist(), logprobs.gather(1, nxt[:, None])[:, 0].tolist(),
            (top2[:, 0] - top2[:, 1]).tolist())


def cause(text: str) -> str:
    """The line of an error's text (or a process's output) that says what went wrong: the last one
    naming an exception (a child's traceback ends with it), else the last line. A stack that died
    at start-up ends its output with the kvstore's CUDA IPC warning about its consumers, which
    says nothing of the cause (gpu-check, 2026-12-04: the router's `import fastapi` had failed)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b:?", line)]
    return (named or lines or [""])[-1][:200]


def row(section: str, check: str, ok, figure: str) -> dict:
    return {"section": section, "check": check, "ok": ok, "figure": figure}


class Rows(list):
    """The rows so far, rewritten to the JSON file at each one: a run cut off at its time limit
    still reports what it had checked."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        path.write_text("[]")

    def append(self, item: dict) -> None:
        super().append(item)
        self.path.write_text(json.dumps(self))


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def completion_bodies(model: str, prompts: list[list[int]]) -> list[dict]:
    """The mix both stacks answer: greedy, n=4 seeded sampling and beam search 4 for each prompt."""
    bodies = []
    for p in prompts:
        common = {"model": model, "prompt": p, "max_tokens": NEW_TOKENS, "ignore_eos": True}
        bodies += [dict(common, temperature=0),
                   dict(common, temperature=1.0, n=4, seed=7),
                   dict(common, n=4, use_beam_search=True, temperature=0)]
    return bodies


async def post_all(url: str, bodies: list[dict]) -> list[list[str]]:
    """All at once (the pressure), each answer as its choices' texts in index order."""
    import httpx
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(bodies) + 4)) as c:
        replies = await asyncio.gather(*(c.post(url + "/v1/completions", json=b) for b in bodies))
    out = []
    for r in replies:
        r.raise_for_status()
        out.append([ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])])
    return out


def preemptions(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:num_preemptions\S*\s+([0-9.eE+]+)$", text, re.M)
    return sum(float(v) for v in found)


def token_texts(model: str, token_lists: list[list[int]]) -> list[str]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.decode(t, skip_special_tokens=True) for t in token_lists]


def stack_flags(device: str, dtype: str, pool: list[str]) -> list[str]:
    return ["--device", device, "--dtype", dtype, "--max-num-batched-tokens", "2048", *pool]


def check_float32_stack(model: str, device: str, prompts, hf32, rows: list, rates) -> list[list[str]]:
    """Sections 2 and 5 on one stack -> its answers to completion_bodies (the pressure reference)."""
    pool = ["--gpu-memory-utilization", "0.8"] if device == "cuda" else ["--num-device-blocks", "4096"]
    t0 = time.perf_counter()
    stack = Stack(model, *stack_flags(device, "float32", pool), timeout_s=240)
    try:
        rows.append(row("server", "float32 stack ready (pool sized after the profile)", True,
                        f"{time.perf_counter() - t0:.0f} s"))
        want = token_texts(model, [hf_greedy(hf32, p, NEW_TOKENS, device) for p in prompts])
        got = [post(stack.url, {"model": model, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                                "ignore_eos": True})["choices"][0]["text"] for p in prompts]
        same = sum(g == w for g, w in zip(got, want))
        rows.append(row("server", f"float32 greedy == transformers on {device}, token for token", same == len(want),
                        f"{same}/{len(want)} prompts"))
        reference = asyncio.run(post_all(stack.url, completion_bodies(model, prompts)))
        for rate in rates:   # loadgen's client and vllm bench serve's metric definitions
            records, _ = drive(stack.url, model, make_requests(32, 256, 128, 2048, seed=1), rate, seed=1)
            m = summarize(records, [99])
            rows.append(row("replay", f"32 requests, 128-256 -> 64-128 tokens, rate {rate or 'inf'}/s", None,
                            f"{m['output_throughput']:.0f} out tok/s, TTFT mean {m['mean_ttft_ms']:.0f} / p99 "
                            f"{m['p99_ttft_ms']:.0f} ms, TPOT mean {m['mean_tpot_ms']:.1f} / p99 "
                            f"{m['p99_tpot_ms']:.1f} ms"))
        return reference
    finally:
        stack.stop()


def check_pressure(model: str, device: str, prompts, reference, rows: list) -> None:
    pool = ["--num-device-blocks", "48", "--preemption-mode", "swap", "--swap-space", "1"]
    stack = Stack(model, *stack_flags(device, "float32", pool), timeout_s=240)
    try:
        got = asyncio.run(post_all(stack.url, completion_bodies(model, prompts)))
        same = sum(g == w for g, w in zip(got, reference))
        n = preemptions(stack.url)
        rows.append(row("server", "48-block pool, swap: greedy, n=4, beam 4 == no pressure",
                        same == len(reference) and n > 0, f"{same}/{len(reference)} equal, {n:.0f} preemptions"))
    finally:
        stack.stop()


def check_bfloat16(model: str, device: str, prompts, rows: list) -> None:
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.sampling_params import SamplingParams
    hf16 = hf_model(model, torch.bfloat16, device)
    seqs = [p + hf_greedy(hf16, p, NEW_TOKENS, device) for p in prompts]
    hf_top, hf_lp, hf_margin = zip(*(hf_scores(hf16, s, device) for s in seqs))
    del hf16
    with Engine(EngineConfig(model=model, device=device, dtype="bfloat16", num_device_blocks=512)) as engine:
        outs = engine.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    agree = total = decisive_agree = decisive = 0
    diffs = []
    for out, tops, lps, margins in zip(outs, hf_top, hf_lp, hf_margin):
        entries = out.prompt_logprobs   # entry i: [logprob of token i + 1, rank, [[id, logprob]]]
        for entry, top, lp, margin in zip(entries, tops, lps, margins):
            same = entry[2][0][0] == top
            agree, total = agree + same, total + 1
            if margin >= DECISIVE_NATS:
                decisive_agree, decisive = decisive_agree + same, decisive + 1
            diffs.append(abs(entry[0] - lp))
    diffs.sort()
    rows.append(row("server", f"bfloat16 top-1 == transformers bf16 where it leads by >= {DECISIVE_NATS} nats "
                    f"(>= {AGREEMENT:.0%})", decisive > 0 and decisive_agree >= AGREEMENT * decisive,
                    f"{decisive_agree}/{decisive}; all positions {agree}/{total} = {agree / total:.2%}"))
    rows.append(row("server", "bfloat16 |logprob - transformers'| of the scored tokens", None,
                    f"mean {sum(diffs) / len(diffs):.4f}, p99 {diffs[int(0.99 * (len(diffs) - 1))]:.4f}, "
                    f"max {diffs[-1]:.4f}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where the rows go")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="a model folder (default: build the 1B-shaped Llama)")
    p.add_argument("--out", default=".cache/gpu-check-llama-1b", help="where the built model goes")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rates", default="4,16,0", help="Poisson rates per second; 0 = all at once")
    args = p.parse_args(argv)
    rows = Rows(Path(args.json))
    try:
        t0 = time.perf_counter()
        model = args.model or build_model(Path(args.out), args.device, args.layers, args.hidden)
        rows.append(row("server", "model ready", True, f"{model} ({time.perf_counter() - t0:.0f} s)"))
        prompts = prompts_for(2048)
        hf32 = hf_model(model, torch.float32, args.device)
        reference = check_float32_stack(model, args.device, prompts, hf32, rows,
                                        [float(r) or None for r in args.rates.split(",")])
        del hf32
        check_pressure(model, args.device, prompts, reference, rows)
        check_bfloat16(model, args.device, prompts, rows)
    except Exception as e:   # one failed section must still leave its row and the others' rows
        rows.append(row("server", "gpu_e2e", False, f"{type(e).__name__}: {cause(str(e))}"))
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
