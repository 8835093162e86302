"""The whole stack as real processes on loopback: launcher, kvstore, worker, scheduler, routers.

The official `openai` SDK, unchanged, talks to it; greedy results must equal transformers'.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pagedserve.loadgen.stack import Stack, alive

# A database of its own per pytest-xdist worker: the routers of one stack pick among every
# replica registered there, and a stack of another test file must not be among them.
REDIS_URL = f"redis://127.0.0.1:6379/{9 + int(os.environ.get('PYTEST_XDIST_WORKER', 'gw0')[2:])}"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Scheduler:", "x = [1, 2, 3]",
           "# A paged KV cache", "while True:", "print('hello')", "async def main():"]


def redis_available() -> bool:
    try:
        import redis
        return bool(redis.Redis.from_url(REDIS_URL, socket_timeout=1).ping())
    except Exception:
        return False


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return (AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_llama))


def hf_greedy_text(hf, ids: list[int], max_new: int) -> str:
    model, tok = hf
    x = torch.tensor([ids])
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)
    return tok.decode(y[0, len(ids):], skip_special_tokens=True)


@pytest.fixture(scope="module")
def stack(tiny_llama):
    if not redis_available():
        pytest.fail("no Redis at 127.0.0.1:6379 (.ci/run starts one)")
    s = Stack(tiny_llama, "--redis-url", REDIS_URL, "--num-device-blocks", "256", routers=2)
    yield s
    s.stop()


def client(url: str):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def get_json(url: str, method: str = "GET"):
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_completions_equal_transformers(stack, tiny_llama, hf):
    c = client(stack.url)
    for prompt in PROMPTS[:4]:
        got = c.completions.create(model=tiny_llama, prompt=prompt, max_tokens=24, temperature=0)
        ids = hf[1](prompt)["input_ids"]
        assert got.choices[0].text == hf_greedy_text(hf, ids, 24), prompt
        assert got.usage.prompt_tokens == len(ids)


def test_chat_equals_transformers(stack, tiny_llama, hf):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    got = client(stack.url).chat.completions.create(model=tiny_llama, messages=messages, max_tokens=24,
                                                    temperature=0)
    ids = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert got.choices[0].message.content == hf_greedy_text(hf, list(ids), 24)


def test_stream_equals_non_stream(stack, tiny_llama):
    c = client(stack.urls[1])
    whole = c.completions.create(model=tiny_llama, prompt=PROMPTS[4], max_tokens=32, temperature=0)
    chunks = c.completions.create(model=tiny_llama, prompt=PROMPTS[4], max_tokens=32, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    chat = c.chat.completions.create(model=tiny_llama, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=16, temperature=0, stream=True)
    assert any(ch.choices and ch.choices[0].delta.content for ch in chat)


def test_n_and_logprobs(stack, tiny_llama):
    c = client(stack.url)
    got = c.completions.create(model=tiny_llama, prompt="import", max_tokens=8, n=3, temperature=1.0, seed=5)
    assert sorted(ch.index for ch in got.choices) == [0, 1, 2]
    got = c.completions.create(model=tiny_llama, prompt="import", max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) > 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_echo_with_logprobs_scores_the_prompt_as_transformers(stack, tiny_llama, hf):
    """Echo with logprobs (how lm-eval scores a text): the prompt's tokens come back with their
    logprobs, which equal transformers' log_softmax, then the completion's."""
    model, tok = hf
    prompt = "def fibonacci(n):\n    return n"
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)     # [P, V]
    got = client(stack.url).completions.create(model=tiny_llama, prompt=prompt, max_tokens=3, temperature=0,
                                               echo=True, logprobs=2)
    lp = got.choices[0].logprobs
    assert got.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) >= 2
    # vLLM's prompt_logprobs field, asked for by name (an extra field for the SDK).
    body = client(stack.url).completions.create(model=tiny_llama, prompt=prompt, max_tokens=1,
                                                extra_body={"prompt_logprobs": 1}).model_dump()
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(ref[0, ids[1]].item(), abs=1e-4)
    assert plp[1][str(ref[0].argmax().item())]["rank"] == 1


def test_bad_request_gets_openai_error(stack, tiny_llama):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client(stack.url).completions.create(model=tiny_llama, prompt="x", max_tokens=4, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in str(e.value)


def test_two_routers_share_requests(stack, tiny_llama):
    """A request made through router 0 is visible and cancellable through router 1."""
    import openai
    request_id = f"shared-{time.time_ns()}"
    c0 = openai.OpenAI(base_url=stack.urls[0] + "/v1", api_key="x", max_retries=0, timeout=120,
                       default_headers={"X-Request-Id": request_id})
    finish = {}

    def long_stream():
        stream = c0.completions.create(model=tiny_llama, prompt="def f():", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
        for ch in stream:
            if ch.choices and ch.choices[0].finish_reason:
                finish["reason"] = ch.choices[0].finish_reason
    t = threading.Thread(target=long_stream)
    t.start()
    record = None
    for _ in range(100):
        try:
            record = get_json(f"{stack.urls[1]}/v1/requests/{request_id}")
            break
        except urllib.error.HTTPError:
            time.sleep(0.1)
    assert record is not None
    get_json(f"{stack.urls[1]}/v1/requests/{request_id}/cancel", method="POST")
    t.join(60)
    assert not t.is_alive() and finish.get("reason") == "abort"


def test_the_running_scheduler_router_and_launcher_have_no_torch_mapped(stack, tiny_llama):
    """The scheduler and the launcher read the model folder without torch (services/model_dir.py),
    and the router loads its tokenizer without it and compiles grammars in a child process
    (services/guided/compile_process.py): none of torch's libraries is in their memory maps, after
    they have served requests, structured outputs among them."""
    import openai
    for url in stack.urls:
        out = client(url).completions.create(model=tiny_llama, prompt="x", max_tokens=3, temperature=0,
                                             extra_body={"structured_outputs": {"regex": "[ab]+"}})
        assert set(out.choices[0].text) <= {"a", "b"}, out.choices[0].text
        with pytest.raises(openai.BadRequestError) as e:
            client(url).completions.create(model=tiny_llama, prompt="x", max_tokens=3,
                                           extra_body={"structured_outputs": {"regex": "a("}})
        assert "does not compile" in str(e.value)
    assert "libtorch" not in Path(f"/proc/{stack.proc.pid}/maps").read_text(), "the launcher maps torch"
    roles = {b"pagedserve.services.scheduler.service": "scheduler", b"pagedserve.services.router.service": "router"}
    seen = set()
    for pid in stack.pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        for module, role in roles.items():
            if module in cmdline:
                assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), f"the {role} process maps torch"
                seen.add(role)
    assert seen == set(roles.values()), f"not found among the stack's processes {stack.pids}: {set(roles.values()) - seen}"


def test_metrics_and_kv(stack):
    with urllib.request.urlopen(stack.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds"):
        assert name in text
    # async scheduling is on: the earlier tests' decode steps were planned while the one before ran
    ahead = [line for line in text.splitlines() if line.startswith("pagedserve:steps_planned_ahead_total{")]
    assert ahead and float(ahead[0].rsplit(" ", 1)[1]) > 0, ahead
    kv = get_json(stack.url + "/v1/kv")
    assert kv["device_blocks_total"] == 256


# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py), by the families that use them.
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "vllm:inter_token_latency_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "vllm:e2e_request_latency_seconds": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    "vllm:iteration_tokens_total": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "vllm:request_params_n": (1, 2, 5, 10, 20),
    "vllm:request_num_preemptions": (1, 2, 3, 4, 5, 10, 20),
}
for _name in ("queue", "inference", "prefill", "decode"):
    VLLM_BUCKETS[f"vllm:request_{_name}_time_seconds"] = VLLM_BUCKETS["vllm:e2e_request_latency_seconds"]
VLLM_BUCKETS["vllm:request_time_per_output_token_seconds"] = VLLM_BUCKETS["vllm:inter_token_latency_seconds"]


def vllm_families() -> list[tuple[str, str, set[str], str]]:
    rows = []
    for line in (Path(__file__).parent / "data" / "vllm_metrics_0.32.tsv").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, kind, labels, ours = line.split("\t")
            rows.append((name, kind, set(labels.split(",")), ours))
    return rows


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def test_metric_families_are_vllms(stack, tiny_llama):
    """Every vLLM family we should have, with its type, labels and buckets, across the routers;
    the engine's own series come from exactly one router (a sum over routers counts them once)."""
    for url in stack.urls:
        client(url).completions.create(model=tiny_llama, prompt=PROMPTS[0], max_tokens=4, n=2)
    scrapes = [scrape(url) for url in stack.urls]
    for name, kind, labels, ours in vllm_families():
        if not ours.startswith("required"):
            continue
        found = [f[name] for f in scrapes if name in f and f[name].samples]
        assert found, f"{name} is missing"
        for family in found:
            assert family.type == kind, (name, family.type, kind)
            names = {k for s in family.samples for k in s.labels} - {"le"}
            if name == "vllm:cache_config_info":
                assert labels <= names, (name, names)
            else:
                assert names == labels, (name, names, labels)
            if name in VLLM_BUCKETS:
                bounds = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
                assert bounds == [float(b) for b in VLLM_BUCKETS[name]] + [float("inf")], name
    # The engine's gauges: once per engine across the routers; what each router saw: on each.
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:iteration_tokens_total",
                 "vllm:num_preemptions"):
        exporters = {}   # engine -> the routers that export its series
        for i, f in enumerate(scrapes):
            for s in f[name].samples:
                exporters.setdefault(s.labels["engine"], set()).add(i)
        assert exporters and all(len(routers) == 1 for routers in exporters.values()), (name, exporters)
    for f in scrapes:
        assert sum(s.value for s in f["vllm:request_params_n"].samples if s.name.endswith("_count")) >= 1


def test_orca_stack_reserves_true_lengths_and_reports_the_kv_split(tiny_llama):
    """--allocation orca-oracle through the processes: a request without true_output_len is a 400,
    one with it is served; /v1/kv and /metrics carry the Fig. 2 split."""
    import httpx
    s = Stack(tiny_llama, "--num-device-blocks", "32", "--allocation", "orca-oracle")
    try:
        body = {"model": tiny_llama, "prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 400 and "true_output_len" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/v1/completions", json={**body, "true_output_len": 8}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        split = get_json(s.url + "/v1/kv")["kv_breakdown"]
        assert sum(split["cache"].values()) == pytest.approx(1.0) and split["cache"]["token_states"] > 0
        with urllib.request.urlopen(s.url + "/metrics", timeout=30) as m:
            assert 'pagedserve:kv_breakdown{' in m.read().decode()
    finally:
        assert s.stop() == 0


def test_preemption_across_processes(tiny_llama):
    """A tiny device pool, swap mode: many concurrent requests, same greedy output as the engine
    without pressure; /v1/kv shows the swaps; stopping leaves no process and no shared memory."""
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.sampling_params import SamplingParams
    with Engine(EngineConfig(model=tiny_llama, num_device_blocks=512)) as engine:
        expected = [o.outputs[0].text for o in engine.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0))]
    s = Stack(tiny_llama, "--num-device-blocks", "10", "--preemption-mode", "swap", "--max-num-seqs", "8")
    try:
        c = client(s.url)
        got = [None] * len(PROMPTS)

        def one(i):
            got[i] = c.completions.create(model=tiny_llama, prompt=PROMPTS[i], max_tokens=40, temperature=0).choices[0].text
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert got == expected
        kv = get_json(s.url + "/v1/kv")
        assert kv["swap_outs"] > 0 and kv["swap_ins"] == kv["swap_outs"], kv
        # A request that outgrows the whole pool is ended by the scheduler while it schedules: its
        # client hears so (it used to wait forever), and the pool is free again. No retry can
        # serve it as asked: a 400, not a retryable 503 (black-box finding).
        import httpx
        r = httpx.post(s.url + "/v1/completions", json={"model": tiny_llama, "prompt": PROMPTS[0],
                                                        "max_tokens": 400, "ignore_eos": True}, timeout=120)
        assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert get_json(s.url + "/v1/kv")["device_blocks_used"] == 0
    finally:
        pids = list(s.pids)
        code = s.stop()
    assert code == 0
    time.sleep(0.5)
    assert not [p for p in pids if alive(p)], "processes left behind"
    assert not [f for p in pids for f in Path("/dev/shm").glob(f"pagedserve-{p}-*")], "shared memory left behind"


def test_scheduler_with_unreachable_kvstore_exits_with_cause(tiny_llama):
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "scheduler", "--model", tiny_llama,
                          "--endpoint", "ipc:///tmp/pagedserve-test-sched.sock",
                          "--kvstore-endpoint", "tcp://127.0.0.1:9", "--startup-timeout", "2"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "kvstore" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_launcher_reports_the_failed_process_and_stops_the_others(tiny_llama):
    """A Redis that does not answer: the scheduler and the router that need it exit with the cause
    in one line; the launcher names the first to go and leaves nothing behind."""
    import subprocess
    import sys
    from pagedserve.loadgen.stack import children_of, free_port
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", "up", "--model", tiny_llama,
                             "--port", str(free_port()), "--redis-url", "redis://127.0.0.1:1/0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    while proc.poll() is None:
        seen.update(children_of(proc.pid))
        time.sleep(0.2)
    err = proc.stderr.read()
    assert proc.returncode != 0 and "cannot use Redis" in err and "Traceback" not in err, err
    assert re.search(r"the (scheduler|router0) process exited with code 1", err), err
    time.sleep(0.5)
    assert seen and not [p for p in seen if alive(p)]


def test_mixed_load_under_pressure_leaves_pool_empty(tiny_llama):
    """60 concurrent requests of every kind (n, beam, stop strings, streams cut short, chat,
    logprobs, penalties) on a 24-block pool in auto mode: all answered, the pool back to empty,
    the stack still ready, a clean stop."""
    import asyncio
    import random
    import httpx
    s = Stack(tiny_llama, "--num-device-blocks", "24", "--preemption-mode", "auto")
    statuses: list[int] = []

    async def one(client, i, rng):
        kind = rng.choice(["plain", "n", "beam", "stop", "stream", "cut", "chat", "logprobs", "penalty"])
        body = {"model": tiny_llama, "prompt": f"def f{i}(x):\n" * rng.randint(1, 6),
                "max_tokens": rng.randint(1, 60), "temperature": rng.choice([0, 0.8])}
        url = s.url + "/v1/completions"
        body.update({"n": {"n": 3, "seed": i}, "beam": {"use_beam_search": True, "n": 2, "temperature": 0},
                     "stop": {"stop": ["\n", "x"]}, "logprobs": {"logprobs": 3},
                     "penalty": {"repetition_penalty": 1.3, "presence_penalty": 0.5}}.get(kind, {}))
        if kind == "chat":
            url = s.url + "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        if kind in ("stream", "cut"):
            body["stream"] = True
            async with client.stream("POST", url, json=body) as r:
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if kind == "cut" and lines > 3:
                        break      # the client goes away mid-stream: the router must abort it
                statuses.append(r.status_code)
            return
        statuses.append((await client.post(url, json=body)).status_code)

    async def run_all():
        rng = random.Random(0)
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*[one(client, i, rng) for i in range(60)])
    try:
        asyncio.run(run_all())
        assert statuses == [200] * 60
        for _ in range(50):      # aborts of cut streams reach the kvstore within a heartbeat
            kv = get_json(s.url + "/v1/kv")
            if kv["num_sequences"] == 0:
                break
            time.sleep(0.1)
        assert kv["device_blocks_used"] == 0 and kv["host_blocks_used"] == 0 and kv["num_sequences"] == 0, kv
        assert get_json(s.url + "/health") is not None
        with urllib.request.urlopen(s.url + "/ready", timeout=10) as r:
            assert r.status == 200
    finally:
        code = s.stop()
    assert code == 0


def test_tensor_parallel_stack_matches_engine(tiny_llama):
    """`pagedserve up --tensor-parallel 2`: two worker ranks (gloo) serve the engine's greedy text."""
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.sampling_params import SamplingParams
    with Engine(EngineConfig(model=tiny_llama, num_device_blocks=128)) as engine:
        expected = [o.outputs[0].text for o in engine.generate(PROMPTS[:3], SamplingParams(max_tokens=16, temperature=0))]
    s = Stack(tiny_llama, "--tensor-parallel", "2", "--num-device-blocks", "128")
    try:
        c = client(s.url)
        got = [c.completions.create(model=tiny_llama, prompt=p, max_tokens=16, temperature=0).choices[0].text
               for p in PROMPTS[:3]]
        assert got == expected
    finally:
        assert s.stop() == 0


def test_stopping_the_stack_answers_requests_in_flight_with_503(tiny_llama):
    """Ctrl-C / SIGTERM with requests running: each client gets a 503 in the OpenAI shape (an SSE
    error event and [DONE] for a stream) at once, not a cut connection or a plain 500 after the
    drain times out (--shutdown-timeout 0: no drain; tests/test_supervision.py has the drain)."""
    import httpx
    s = Stack(tiny_llama, "--num-device-blocks", "128", "--shutdown-timeout", "0")
    out = {}
    body = {"model": tiny_llama, "prompt": "hi", "max_tokens": 900, "ignore_eos": True}

    def plain():
        out["plain"] = httpx.post(s.url + "/v1/completions", json=body, timeout=60)

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out["stream"] = [line for line in r.iter_lines() if line]
    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while get_json(s.url + "/v1/kv")["num_sequences"] < 2:    # both are running
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stopped = time.monotonic()
        code = s.stop()
    for t in threads:
        t.join(60)
    assert code == 0 and time.monotonic() - stopped < 10
    assert out["plain"].status_code == 503 and out["plain"].json()["error"]["code"] == 503
    assert out["stream"][-1] == "data: [DONE]" and json.loads(out["stream"][-2][6:])["error"]["code"] == 503


DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "pagedserve.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's variables as a user's default view has them."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$__rate_interval", "30s").replace("$model_name", ".*"))
            for p in panels for t in p.get("targets", [])]


def test_every_dashboard_query_returns_data_from_a_real_prometheus(stack, tiny_llama, tmp_path):
    """A real Prometheus scrapes both routers while a little traffic runs; every query of the
    Grafana dashboard (deploy/) must return series through Prometheus's HTTP API."""
    import shutil
    import subprocess
    import httpx
    from pagedserve.loadgen.stack import free_port
    binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if binary is None:
        pytest.skip("no prometheus binary (Debian's `prometheus` package; .ci/run installs it)")
    targets = ", ".join(f'"{u.removeprefix("http://")}"' for u in stack.urls)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: pagedserve\n    static_configs: [{{targets: [{targets}]}}]\n")
    port = free_port()
    prom = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 90
        body = {"model": tiny_llama, "max_tokens": 6}
        missing: list = []
        while time.monotonic() < deadline:
            for i, url in enumerate(stack.urls):   # a shared prefix (cache hits), n=2, a 400
                httpx.post(url + "/v1/completions", json={**body, "prompt": PROMPTS[0] * 8 + str(i), "n": 2},
                           timeout=60)
                httpx.post(url + "/v1/completions", json={**body, "prompt": "x", "n": 0}, timeout=60)
            time.sleep(1)
            try:
                results = {(title, expr): httpx.get(api + "/query", params={"query": expr}, timeout=10).json()
                           for title, expr in dashboard_queries()}
            except httpx.HTTPError:   # Prometheus still starting
                continue
            assert all(r["status"] == "success" for r in results.values()), results
            missing = [key for key, r in results.items() if not r["data"]["result"]]
            ttft = results[next(k for k in results if k[0] == "Time to first token")]["data"]["result"]
            if not missing and ttft and ttft[0]["value"][1] != "NaN":
                break
        assert not missing, f"dashboard queries without data: {missing}"
        models = httpx.get(api + "/label/model_name/values", timeout=10).json()["data"]
        assert tiny_llama in models    # the dashboard's model variable
    finally:
        prom.terminate()
        prom.wait(10)


def test_phases_of_requests_the_router_ended_and_ttft_per_prompt(stack, tiny_llama):
    """A request ended by a stop string (the router aborts it) still gets the engine's phases, as
    soon as the scheduler's final update arrives; a list of prompts times each first token."""
    import httpx

    def sums(url):
        f = scrape(url)

        def total(name, suffix):
            return sum(s.value for s in f[name].samples if s.name.endswith(suffix))
        return {"decode_sum": total("vllm:request_decode_time_seconds", "_sum"),
                "decode_count": total("vllm:request_decode_time_seconds", "_count"),
                "ttft_count": total("vllm:time_to_first_token_seconds", "_count")}
    url = stack.urls[1]
    body = {"model": tiny_llama, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    text = httpx.post(url + "/v1/completions", json={**body, "prompt": PROMPTS[1]}, timeout=60).json()
    stop = text["choices"][0]["text"][6:9]        # a stop string a few tokens in
    time.sleep(0.5)
    before = sums(url)
    r = httpx.post(url + "/v1/completions", json={**body, "prompt": PROMPTS[1], "stop": [stop]}, timeout=60)
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 10
    while (after := sums(url))["decode_sum"] == before["decode_sum"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["decode_count"] - before["decode_count"] == 1
    assert after["decode_sum"] > before["decode_sum"]      # its decode phase, not a 0
    httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2, "prompt": PROMPTS[2:4]}, timeout=60)
    assert sums(url)["ttft_count"] - after["ttft_count"] == 2
