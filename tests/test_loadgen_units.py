"""loadgen's cores without a server: arrivals, trace parsing, length fitting, prefix synthesis,
metric definitions, the sweep's rate search, and the flags derived from the config dataclasses."""
from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from pagedserve.loadgen.client import RequestRecord
from pagedserve.loadgen.config import ReplayConfig, SweepConfig, parse_goodput
from pagedserve.loadgen.metrics import summarize, timeline
from pagedserve.loadgen.scrape import parse_metrics
from pagedserve.loadgen.sweep import auto_rates, sustained_rate
from pagedserve.loadgen.traces import SHIPPED, Trace, TraceError, TraceRequest, load_trace
from pagedserve.loadgen.workload import (Prompts, build_plan, fit_to_context, poisson_arrivals, prefix_cache_bound,
                              trace_arrivals)
from pagedserve.services.flags import ConfigError, from_args


# ---- arrivals

@pytest.mark.parametrize("rate,burstiness", [(5.0, 1.0), (20.0, 0.25), (2.0, 4.0)])
def test_arrivals_have_the_rate_and_the_burstiness(rate, burstiness):
    times = poisson_arrivals(20000, rate, burstiness, random.Random(7))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.04)
    # Gamma gaps of shape B: coefficient of variation 1 / sqrt(B) (1 for Poisson).
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert poisson_arrivals(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5


def test_same_seed_same_arrivals_scaled_by_rate():
    a = poisson_arrivals(50, 2.0, 1.0, random.Random("s"))
    b = poisson_arrivals(50, 8.0, 1.0, random.Random("s"))
    assert [x / 4 for x in a] == pytest.approx(b)


def test_bucketed_trace_times_spread_over_the_bucket():
    # Mooncake-like: stamps in 3 s buckets, several requests each.
    stamps = [0.0, 0.0, 0.0, 3.0, 3.0, 6.0, 6.0, 6.0, 6.0]
    assert trace_arrivals(stamps) == pytest.approx([0, 1, 2, 3, 4.5, 6, 6.75, 7.5, 8.25])
    assert trace_arrivals(stamps, speed=3)[:3] == pytest.approx([0, 1 / 3, 2 / 3])
    # Distinct stamps (Azure) are kept as they are.
    assert trace_arrivals([0.0, 0.5, 0.7, 2.0], speed=2) == pytest.approx([0, 0.25, 0.35, 1.0])


def test_mooncake_conversation_replays_without_bursts():
    trace = load_trace("mooncake-conversation", num_requests=400)
    times = trace_arrivals([r.timestamp for r in trace.requests])
    assert times == sorted(times)
    assert len(set(times)) == len(times)          # no two arrivals at the same instant
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 10                         # and the hour-long rate is kept


# ---- traces

@pytest.mark.parametrize("name,rows,first", [
    ("azure-code", 8819, (4808, 10)), ("azure-conv", 19366, None),
    ("mooncake-conversation", 12031, (6758, 500)), ("mooncake-synthetic", 3993, None)])
def test_shipped_traces_parse_whole(name, rows, first):
    trace = load_trace(name, num_requests=10**9)
    assert len(trace.requests) == rows and trace.has_times
    assert trace.requests[0].timestamp == 0.0
    assert all(b.timestamp >= a.timestamp for a, b in zip(trace.requests, trace.requests[1:])) or \
        name.startswith("mooncake")           # Mooncake's synthetic trace is not sorted
    if first:
        assert (trace.requests[0].input_len, trace.requests[0].output_len) == first
    if name.startswith("mooncake"):
        assert trace.block_tokens == 512
        assert all(len(r.hash_ids) == -(-r.input_len // 512) for r in trace.requests)
    else:
        assert trace.block_tokens is None


def test_azure_times_are_seconds_from_the_first_request():
    code = load_trace("azure-code", num_requests=10**9).requests
    # 18:17:03.98 to 19:14:19.93 (the traces README): a span of 3,435.9 s.
    assert code[-1].timestamp == pytest.approx(3435.95, abs=0.01)
    assert code[1].timestamp == pytest.approx(0.052, abs=1e-4)


def test_shipped_traces_are_package_data(tmp_path):
    from importlib import resources
    folder = resources.files("pagedserve.loadgen") / "traces"
    for file, _ in SHIPPED.values():
        assert (folder / file).is_file()
    assert "CC-BY 4.0" in (folder / "README.md").read_text() and "Splitwise" in (folder / "README.md").read_text()
    # Found from any working folder, as the installed `loadgen` command runs (it found them only
    # from a checkout's root, where the folder loadgen/ imports as "loadgen").
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from pagedserve.loadgen.traces import SHIPPED, trace_path\n"
                          "print(all(trace_path(n).is_file() for n in SHIPPED))"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_user_jsonl(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in [
        {"input_length": 600, "output_length": 5, "timestamp": 1500, "hash_ids": [7, 8]},
        {"prompt": "hello there world", "output_length": 3, "timestamp": 2000},
        {"input_length": 12, "output_length": 1, "timestamp": 2500.5},
    ]) + "\n\n")
    trace = load_trace(str(path), num_requests=100)
    assert [r.timestamp for r in trace.requests] == pytest.approx([0.0, 0.5, 1.0005])
    assert trace.requests[0].hash_ids == [7, 8] and trace.block_tokens == 512
    assert trace.requests[1].prompt == "hello there world"
    assert load_trace(str(path), num_requests=2).requests[-1].output_len == 3


@pytest.mark.parametrize("line,message", [
    ('{"output_length": 3}', "needs 'prompt' or 'input_length'"),
    ('{"input_length": 0, "output_length": 3}', "'input_length' must be an integer in"),
    ('{"input_length": 1%s, "output_length": 3}' % ("0" * 340), "'input_length' must be an integer in"),
    ('{"input_length": 6, "output_length": 3, "timestamp": NaN}', "'timestamp' must be"),
    ('{"input_length": 6, "output_length": 3, "timestamp": Infinity}', "'timestamp' must be"),
    ('{"input_length": 5, "output_length": true}', "'output_length' must be"),
    ('{"input_length": 600, "output_length": 3, "hash_ids": [1]}', "expected 2"),
    ('{"input_length": 6, "output_length": 3, "timestamp": "x"}', "'timestamp' must be"),
    ('[1, 2]', "JSON object"),
    ('{"input_length": 6, "output_length": 3', "Expecting"),
])
def test_bad_jsonl_names_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 6, "output_length": 3}\n' + line + "\n")
    with pytest.raises(TraceError, match=rf"bad.jsonl:2: .*{message}"):
        load_trace(str(path), num_requests=10)


def test_unknown_trace_and_half_timestamped_file(tmp_path):
    with pytest.raises(TraceError, match="neither a file nor one of"):
        load_trace("no-such-trace", num_requests=1)
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"input_length": 6, "output_length": 3, "timestamp": 0}\n{"input_length": 6, "output_length": 3}\n')
    with pytest.raises(TraceError, match="some requests have a timestamp"):
        load_trace(str(path), num_requests=10)


def test_random_trace_is_vllms_random_dataset():
    reqs = load_trace("random", num_requests=2000, input_len=100, output_len=20, range_ratio=0.5).requests
    assert min(r.input_len for r in reqs) == 50 and max(r.input_len for r in reqs) == 150
    assert {r.output_len for r in load_trace("random", num_requests=5, output_len=7).requests} == {7}


# ---- fitting lengths to the context

def _trace(pairs, block=None, hashes=None):
    reqs = [TraceRequest(p, o, float(i), hashes[i] if hashes else None) for i, (p, o) in enumerate(pairs)]
    return Trace("t", "test", reqs, block)


def test_scale_fits_the_p99_and_caps_the_rest():
    pairs = [(100, 100)] * 99 + [(3000, 1000)]
    fitted, fit = fit_to_context(_trace(pairs), 1024, "scale")
    # p99 of the totals is 200 (the 100th value is the outlier): nothing is shrunk...
    assert fit.factor == 1.0 and fit.capped == 1
    assert fitted[-1].input_len + fitted[-1].output_len <= 1024 and fitted[-1].input_len == 1023
    pairs = [(1000, 1000)] * 100
    fitted, fit = fit_to_context(_trace(pairs), 1000, "scale")
    assert fit.factor == pytest.approx(0.5) and fit.capped == 0
    assert {(r.input_len, r.output_len) for r in fitted} == {(500, 500)}


def test_filter_drops_what_does_not_fit_and_counts_it():
    fitted, fit = fit_to_context(_trace([(10, 10), (1000, 30), (1000, 24), (5, 2000)]), 1024, "filter")
    assert [(r.input_len, r.output_len) for r in fitted] == [(10, 10), (1000, 24)]
    assert fit.dropped == 2 and fit.factor == 1.0
    assert "2 dropped" in fit.describe()


def test_trace_blocks_become_whole_kv_blocks():
    # 1,100 tokens = two full 512-token trace blocks + 76; scaled by 0.1 -> 51.2, rounded to 48 (3 KV blocks).
    trace = _trace([(1100, 10)] * 100, block=512, hashes=[[1, 2, 3]] * 100)
    fitted, fit = fit_to_context(trace, 111, "scale", kv_block_size=16)
    assert fit.block_tokens == 48
    assert fitted[0].input_len == 2 * 48 + round(76 * 48 / 512)
    # Never below one KV block, whatever the factor.
    _, tiny = fit_to_context(_trace([(100000, 10)] * 10, block=512, hashes=[list(range(196))] * 10), 100, "scale")
    assert tiny.block_tokens == 16


_LONG_EVERY_200 = [(3000, 1000) if i % 200 == 7 else (100, 100) for i in range(1000)]


def test_the_fit_counts_the_requests_sent_not_the_whole_trace():
    # 5 of the trace's 1000 requests are too long, one of them among the first 40 sent.
    pairs = _LONG_EVERY_200
    assert fit_to_context(_trace(pairs), 1024, "scale")[1].capped == 5
    plan = _plan(_trace(pairs), max_model_len=1024, fit_mode="scale", num_requests=40)
    assert len(plan.requests) == 40 and plan.fit.capped == 1 and plan.fit.sent == 40
    assert "1 of 40 capped" in plan.fit.describe()
    # filter: the trace's requests skipped to find the 40 sent (1 of the first 41).
    plan = _plan(_trace(pairs), max_model_len=1024, fit_mode="filter", num_requests=40)
    assert (plan.fit.dropped, plan.fit.read) == (1, 41) and "1 of the first 41 in the trace dropped" in plan.fit.describe()


def test_the_report_states_the_fit_once_and_the_prefix_cache_in_plain_rows():
    from pagedserve.loadgen.replay import RunResult, Server
    from pagedserve.loadgen.report import markdown, summary_of
    plan = _plan(_trace(_LONG_EVERY_200), max_model_len=1024, fit_mode="scale", num_requests=40)
    samples = [{"prefix_cache_queries": 100.0, "prefix_cache_hits": 10.0, "external_prefix_cache_hits": 0.0},
               {"prefix_cache_queries": 1100.0, "prefix_cache_hits": 310.0, "external_prefix_cache_hits": 200.0}]
    result = RunResult(from_args(ReplayConfig, {}, num_requests=40), Server("http://x", "m", 1024), plan, [],
                       samples, 0.0, notes=plan.notes)
    text = markdown(summary_of(result), result, [])
    assert "40 requests" in text and text.count("capped") == 1 and "1 of 40 capped" in text
    assert "| prefix-cache hits, share of prompt tokens | 50.0 % (device 30.0 %, host 20.0 %) |" in text
    assert f"| prefix-cache hits a cache that never evicts would get | {100 * plan.prefix_bound:.1f} % |" in text


def test_bad_fit_arguments():
    with pytest.raises(ValueError, match="--fit"):
        fit_to_context(_trace([(1, 1)]), 100, "squash")
    with pytest.raises(ValueError, match="no room"):
        fit_to_context(_trace([(1, 1)]), 1, "scale")


# ---- prompts and prefixes

def _plan(trace, **kw):
    args = dict(max_model_len=4096, fit_mode="filter", kv_block_size=16, seed=3, rate=math.inf, burstiness=1.0,
                trace_times=False, speed=1.0, duration=None, num_requests=None, warmup=0,
                pool=list(range(10, 1000)))
    args.update(kw)
    return build_plan(trace, **args)


def test_equal_hash_ids_give_equal_blocks_and_different_ids_different_ones():
    hashes = [[0, 1, 2], [0, 1, 5], [0, 9], [4]]
    trace = _trace([(1300, 4), (1400, 4), (700, 4), (300, 4)], block=512, hashes=hashes)
    plan = _plan(trace)
    blocks = {}
    for req, hs in zip(plan.requests, hashes):
        assert len(req.prompt) == req.input_len
        for i, h in enumerate(hs):
            chunk = tuple(req.prompt[i * 512:(i + 1) * 512])
            if i < len(hs) - 1:                  # full blocks: equal ids, equal tokens
                assert blocks.setdefault((h, len(chunk)), chunk) == chunk
            else:                                # the partial last block is that id's block's start
                full = [v for (hh, n), v in blocks.items() if hh == h]
                assert all(f[:len(chunk)] == chunk for f in full)
            blocks.setdefault((h, len(chunk)), chunk)
    a, b = plan.requests[0].prompt, plan.requests[1].prompt
    assert a[:1024] == b[:1024] and a[1024:1300] != b[1024:1300]
    assert plan.requests[2].prompt[:512] == a[:512] and plan.requests[2].prompt[512:700] != a[512:700]
    assert plan.requests[3].prompt[:300] != a[:300]
    assert [r.prefix_blocks for r in plan.requests] == [3, 3, 2, 1]


def test_the_infinite_cache_bound_counts_chained_full_blocks_before_the_last_token():
    a = list(range(40))                      # 2 full blocks of 16 before its last token
    assert prefix_cache_bound([a], 16) == 0.0
    assert prefix_cache_bound([a, a], 16) == 32 / 80
    b = a[:16] + [99] * 24                   # shares block 0 only
    c = [7] * 16 + a[16:]                    # block 1's tokens after another block 0: no hit
    assert prefix_cache_bound([a, b, c], 16) == 16 / 120
    assert prefix_cache_bound([a[:32], a[:32]], 16) == 16 / 64   # the last token's block is computed
    hashes = [[0, 1, 2], [0, 1, 5], [0, 9], [4]]
    plan = _plan(_trace([(1300, 4), (1400, 4), (700, 4), (300, 4)], block=512, hashes=hashes))
    # Request 1 hits blocks 0-1 (1024 tokens), request 2 block 0 (512); 16-token KV blocks.
    assert plan.prefix_bound == pytest.approx((1024 + 512) / (1300 + 1400 + 700 + 300))


def test_the_prefix_cache_summary_takes_the_counters_over_the_run():
    from pagedserve.loadgen.report import prefix_cache_of
    samples = [{"prefix_cache_queries": 100.0, "prefix_cache_hits": 10.0, "external_prefix_cache_hits": 0.0},
               {"prefix_cache_queries": None, "prefix_cache_hits": None, "external_prefix_cache_hits": None},
               {"prefix_cache_queries": 1100.0, "prefix_cache_hits": 310.0, "external_prefix_cache_hits": 200.0}]
    pc = prefix_cache_of(samples, 0.6)
    assert (pc["device_hit_rate"], pc["host_hit_rate"], pc["hit_rate"]) == (0.3, 0.2, 0.5)
    assert pc["infinite_cache_bound"] == 0.6
    assert prefix_cache_of(samples[:1], None)["hit_rate"] is None   # one reading: no rate


def test_requests_without_hash_ids_share_nothing_and_the_seed_fixes_everything():
    trace = _trace([(64, 4)] * 20)
    plan = _plan(trace)
    firsts = {tuple(r.prompt[:16]) for r in plan.requests}
    assert len(firsts) == 20
    assert [r.prompt for r in _plan(trace).requests] == [r.prompt for r in plan.requests]
    assert [r.prompt for r in _plan(trace, seed=4).requests] != [r.prompt for r in plan.requests]


def test_warmup_requests_have_prompts_of_their_own():
    trace = _trace([(1024, 4)] * 6, block=512, hashes=[[0, 1]] * 6)
    plan = _plan(trace, warmup=2)
    assert len(plan.warmup) == 2 and len(plan.requests) == 6
    assert all(w.prompt[:512] != plan.requests[0].prompt[:512] for w in plan.warmup)


def test_duration_and_count_cut_the_plan():
    trace = _trace([(8, 2)] * 200)
    plan = _plan(trace, rate=10.0, duration=5.0)
    assert all(r.arrival < 5.0 for r in plan.requests) and 30 < len(plan.requests) < 75
    assert len(_plan(trace, rate=10.0, num_requests=7).requests) == 7
    with pytest.raises(ValueError, match="no timestamps"):
        _plan(Trace("x", "x", [TraceRequest(5, 5)]), trace_times=True)


@pytest.mark.parametrize("chat", [False, True])
def test_text_prompts_tokenize_to_their_length_and_keep_blocks(tiny_llama, chat):
    """What the server sees (BOS, or the chat template around the message, included) has the planned
    length, and the trace's blocks start on the server's 16-token KV block boundaries: equal hash
    ids give equal KV blocks, the first different id a different one."""
    from pagedserve.loadgen.text_prompts import TextCodec
    codec = TextCodec(tiny_llama, chat=chat)
    assert codec.offset >= 1 and codec.added >= codec.offset
    trace = _trace([(100, 4), (80, 4), (37, 4)], block=32, hashes=[[1, 2, 3, 4], [1, 2, 9], [1, 5]])
    plan = _plan(trace, pool=codec.pool, codec=codec, kv_block_size=16)
    assert not plan.notes
    tok = codec.tokenizer
    if chat:
        ids = [list(tok.apply_chat_template([{"role": "user", "content": r.prompt}], tokenize=True,
                                            add_generation_prompt=True)["input_ids"]) for r in plan.requests]
    else:
        ids = [tok(r.prompt)["input_ids"] for r in plan.requests]
    assert [len(i) for i in ids] == [r.input_len for r in plan.requests] == [100, 80, 37]
    kv = lambda seq, k: seq[16 * k:16 * (k + 1)]
    assert [kv(ids[0], k) == kv(ids[1], k) for k in range(5)] == [True] * 4 + [False]
    assert [kv(ids[0], k) == kv(ids[2], k) for k in range(3)] == [True, True, False]


def test_prompts_block_cache_is_stable():
    p = Prompts(list(range(10, 50)), seed=1)
    assert p.block(5, 8) == p.block(5, 16)[:8] == Prompts(list(range(10, 50)), seed=1).block(5, 8)


# ---- metrics

def _rec(i, send, first, events, end, out_tokens, input_len=10, asked=None, error=None):
    r = RequestRecord(i, send, input_len, asked or out_tokens, send=send, first_token=first,
                      token_times=events, end=end, prompt_tokens=input_len, output_tokens=out_tokens, error=error)
    return r


def test_metric_definitions_on_a_scripted_stream():
    recs = [
        _rec(0, 0.0, 0.1, [0.1, 0.2, 0.3, 0.4], 0.4, 4),          # TTFT 100, TPOT 100, E2E 400
        _rec(1, 0.5, 0.8, [0.8, 0.9], 1.0, 4),                    # TTFT 300, TPOT 66.7 (2 events, 4 tokens)
        _rec(2, 1.0, 1.05, [1.05], 1.05, 1),                      # one token: no TPOT
        _rec(3, 1.0, None, [], 1.5, None, error="http_503"),
    ]
    s = summarize(recs, [50, 90, 99.9], {"ttft": 200, "tpot": 150})
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == {"http_503": 1}
    assert s["duration"] == pytest.approx(1.5)
    assert s["total_output_tokens"] == 9 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(6.0)
    assert s["total_token_throughput"] == pytest.approx(26.0)
    assert s["mean_ttft_ms"] == pytest.approx(150.0)
    assert s["median_ttft_ms"] == pytest.approx(100.0)
    assert s["std_ttft_ms"] == pytest.approx(statistics.pstdev([100, 300, 50]))
    assert s["mean_tpot_ms"] == pytest.approx((100 + 200 / 3) / 2)
    assert s["mean_itl_ms"] == pytest.approx(100.0) and s["p50_itl_ms"] == pytest.approx(100.0)
    assert s["mean_e2el_ms"] == pytest.approx((400 + 500 + 50) / 3)
    assert "p99.9_e2el_ms" in s and s["p90_ttft_ms"] == pytest.approx(260.0)
    # Goodput: request 1 misses the TTFT SLO; request 2 has no TPOT (counts as 0) and passes.
    assert s["request_goodput"] == pytest.approx(2 / 1.5)
    assert s["mean_normalized_latency_s_per_token"] == pytest.approx((0.4 / 4 + 0.5 / 4 + 0.05 / 1) / 3)
    assert s["max_concurrent_requests"] == 2
    assert s["short_outputs"] == 0


def test_short_outputs_and_no_slo():
    s = summarize([_rec(0, 0.0, 0.1, [0.1, 0.2], 0.2, 2, asked=5)], [50], None)
    assert s["short_outputs"] == 1 and s["request_goodput"] is None


def test_empty_run_is_all_zeros():
    s = summarize([], [99], None)
    assert s["completed"] == 0 and s["duration"] == 0 and s["mean_ttft_ms"] == 0


def test_timeline_counts_tokens_and_requests_in_flight():
    series = timeline([_rec(0, 0.0, 0.1, [0.1, 0.2], 1.0, 4), _rec(1, 0.5, 0.6, [0.6], 1.5, 2)], step=0.5)
    assert series["t"] == [0.0, 0.5, 1.0, 1.5]
    assert sum(v * 0.5 for v in series["tokens_per_s"]) == pytest.approx(6)
    assert series["in_flight"] == [1, 2, 1, 0]


def test_scraped_metrics_sum_over_engines_and_know_old_names():
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0"} 3\n'
            'vllm:num_requests_running{engine="1"} 2\nvllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:num_preemptions_total{model_name="m"} 7\nvllm:prefix_cache_hits_total 10\nother 1\n')
    m = parse_metrics(text)
    assert m["running"] == 5 and m["kv_cache_usage"] == 0.25 and m["preemptions"] == 7
    assert m["prefix_cache_hits"] == 10 and m["waiting"] is None


# ---- sweep and options

def test_auto_rates_spread_below_saturation():
    assert auto_rates(10.0, 5) == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert auto_rates(3.33333, 3) == [1.11, 2.22, 3.33]
    rows = [{"rate": r, "completed": 5, "failed": f, "normalized_latency": nl} for r, nl, f in
            [(math.inf, 9.0, 0), (1.0, 0.01, 0), (2.0, 0.02, 0), (3.0, 0.05, 1), (4.0, 0.5, 0)]]
    # 3 req/s is under the bound but lost a request: it does not hold.
    assert sustained_rate(rows, 0.1) == 2.0 and sustained_rate(rows, 0.001) is None
    assert sustained_rate(rows, None) is None


def test_flags_are_derived_and_checked(monkeypatch):
    from pagedserve.loadgen.cli import parser
    args = parser().parse_args(["replay", "--rate", "4", "--percentiles", "50,95", "99",
                                "--goodput", "ttft:500", "tpot:50", "--stream", "--max-concurrency", "none"])
    cfg = from_args(ReplayConfig, {k: v for k, v in vars(args).items() if k != "command"})
    assert cfg.rate == 4.0 and cfg.percentiles == [50.0, 95.0, 99.0] and cfg.stream is True
    assert cfg.slos == {"ttft": 500.0, "tpot": 50.0} and cfg.max_concurrency is None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    assert from_args(ReplayConfig, {}).api_key == "sk-x"
    for bad, flag in [({"rate": "0"}, "--rate"), ({"fit": "squash"}, "--fit"), ({"percentiles": ["100"]}, "--percentiles"),
                      ({"goodput": ["latency:5"]}, "--goodput"), ({"num_requests": "x"}, "--num-requests")]:
        with pytest.raises(ConfigError, match=flag):
            from_args(ReplayConfig, bad)
    assert from_args(SweepConfig, {"rates": ["1,2", "4"]}).rate_values() == [1.0, 2.0, 4.0]
    assert from_args(SweepConfig, {}).rate_values() is None
    with pytest.raises(ConfigError, match="--rates"):
        from_args(SweepConfig, {"rates": ["fast"]})
    with pytest.raises(ValueError):
        parse_goodput(["ttft:-1"])
    # Across fields: a TTFT goal cannot be judged on responses that are not streamed.
    with pytest.raises(ConfigError, match="need streamed responses"):
        from_args(ReplayConfig, {"stream": False, "goodput": ["ttft:100"]})
    assert from_args(ReplayConfig, {"stream": False, "goodput": ["e2el:100"]}).slos == {"e2el": 100.0}


def test_bad_flag_is_one_line_and_exit_2(capsys):
    from pagedserve.loadgen.cli import main
    assert main(["replay", "--rate", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rate -1.0: must be > 0" in err


def test_out_that_cannot_be_written_is_refused_before_sending(tmp_path, capsys):
    from pagedserve.loadgen.cli import main
    (tmp_path / "afile").write_text("")
    # Port 9 (discard): nothing is asked of it, the folder is checked first.
    assert main(["replay", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "afile")]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["compare", str(tmp_path), "--out", str(tmp_path / "afile" / "x")]) == 2


def test_compare_names_a_folder_that_is_not_a_run(tmp_path, capsys):
    from pagedserve.loadgen.cli import main
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text("not json")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "summary.json").write_text('{"label": "x"}')
    for folder in ("bad", "half", "missing"):
        assert main(["compare", str(tmp_path / folder), "--out", str(tmp_path / "cmp")]) == 2
        err = capsys.readouterr().err
        assert folder in err and err.count("\n") == 1


def test_the_seed_fixes_the_requests_whatever_their_count_rate_or_duration():
    from pagedserve.loadgen.replay import Server, make_plan
    server = Server("http://x", "m", 1024)
    plans = [make_plan(from_args(ReplayConfig, {}, trace="sharegpt", **kw), server) for kw in
             ({"num_requests": 3}, {"num_requests": 200}, {"rate": 1.0, "duration": 30.0}, {"rate": 50.0, "duration": 30.0})]
    firsts = [[(r.input_len, r.output_len, r.prompt) for r in p.requests[:3]] for p in plans]
    assert all(f == firsts[0] for f in firsts)


def test_a_users_text_too_long_for_the_context_is_dropped(tmp_path):
    trace = Trace("t", "t", [TraceRequest(2000, 10, prompt="long"), TraceRequest(5, 2000, prompt="short")])
    fitted, fit = fit_to_context(trace, 1024, "scale")
    # The long text goes (it cannot be shortened); the short one keeps its text, its output is scaled.
    assert [(r.input_len, r.output_len) for r in fitted] == [(5, 1019)] and fit.dropped == 1
    assert "1 dropped" in fit.describe()


def test_a_tokenizer_that_is_not_a_folder_is_one_line(tmp_path):
    from pagedserve.loadgen.replay import ReplayError, Server, make_plan
    with pytest.raises(ReplayError, match="no such folder"):
        make_plan(from_args(ReplayConfig, {}, tokenizer=str(tmp_path / "nope")), Server("http://x", "m", 1024))


def test_an_unbounded_run_is_short_and_a_long_one_is_announced():
    """No --num-requests: 200 requests, not a whole trace file (azure-conv is 19,365: 2.7 h at
    2 req/s); --duration bounds by time instead; a long plan is a warning before it starts."""
    from pagedserve.loadgen.replay import DEFAULT_REQUESTS, Server, make_plan, plan_line
    server = Server("http://x", "m", 1024)
    plan = lambda **kw: make_plan(from_args(ReplayConfig, {}, **kw), server)
    for trace in ("azure-conv", "sharegpt"):
        assert len(plan(trace=trace, rate=2.0).requests) == DEFAULT_REQUESTS
    timed = plan(trace="azure-conv", rate=20.0, duration=30.0).requests
    assert 450 < len(timed) < 750 and timed[-1].arrival < 30
    cfg = from_args(ReplayConfig, {}, trace="azure-conv", rate=2.0, num_requests=19365)
    line = plan_line(cfg, make_plan(cfg, server))
    assert line.startswith("loadgen: warning: 19,365 requests of azure-conv") and "2.7 h" in line
    assert plan_line(from_args(ReplayConfig, {}), plan()) == "loadgen: 200 requests of sharegpt, all at once"
