"""Differential testing of the OpenAI-compatible API: one list of requests, two servers (or one
server and the expectations recorded from ours), every difference reported.

What is compared for each request (an "observation"):
- the status code;
- JSON bodies: the shape, i.e. the field set and the JSON type of every value, recursively; a null
  counts as an absent field (clients treat them alike); maps keyed by token (logprobs) have their
  keys folded; usage.prompt_tokens_details is left out (it shows prefix-cache hits, which depend
  on what ran before); for errors only the status and the error's field set;
- SSE streams: the framing (every event one `data: ` line and a blank line, `[DONE]` once and last,
  the content type), the set of distinct chunk shapes, whether a usage chunk ends it;
- for deterministic requests (greedy, beam search): the content, i.e. each choice's text, finish
  reason and token counts; logprobs only by shape.

    python -m pagedserve.loadgen.differential record --url http://127.0.0.1:8000           # rewrite the data file
    python -m pagedserve.loadgen.differential check --url http://127.0.0.1:8000            # vs the recorded file
    python -m pagedserve.loadgen.differential compare --url http://ours --peer-url http://vllm   # two servers

`check` and `compare` print one line per difference and exit 1 if any (with `compare`, differences
on cases marked `deliberate` are printed as such and do not count).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
from pathlib import Path

DATA_FILE = Path(__file__).resolve().parents[1] / "tests" / "data" / "differential.jsonl"
# Fields whose presence depends on what ran before, not on the request: usage's cached-token count
# appears once the prefix cache hits (vLLM shows it only with --enable-prompt-tokens-details).
VARYING = ("prompt_tokens_details",)


# ---- the file ----------------------------------------------------------------------------------

def load_cases(path: Path = DATA_FILE) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_cases(cases: list[dict], path: Path = DATA_FILE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False, sort_keys=True) + "\n")


# ---- sending -----------------------------------------------------------------------------------

class Server:
    """What placeholders need to know of a server: its model's name and context length."""

    def __init__(self, url: str, model: str, max_model_len: int):
        self.url, self.model, self.max_model_len = url.rstrip("/"), model, max_model_len

    @classmethod
    async def discover(cls, client, url: str) -> "Server":
        r = await client.get(url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        first = r.json()["data"][0]
        return cls(url, first["id"], int(first["max_model_len"]))


def materialize(value, server: Server):
    """The case's body with "$MODEL", {"$tokens": "L-4"} (that many token ids) and {"$int": "L"}
    filled in for this server."""
    if value == "$MODEL":
        return server.model
    if isinstance(value, dict):
        if len(value) == 1 and set(value) <= {"$tokens", "$int"}:
            (kind, expr), = value.items()
            n = eval(expr, {"__builtins__": {}}, {"L": server.max_model_len})   # "L-4", from our own file
            return [5 + i % 7 for i in range(n)] if kind == "$tokens" else n
        return {k: materialize(v, server) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v, server) for v in value]
    return value


async def send(client, server: Server, case: dict) -> dict:
    """Send one case; return its observation."""
    kwargs: dict = {"headers": dict(case.get("headers") or {})}
    if "raw" in case:
        kwargs["content"] = case["raw"].encode()
    elif "body" in case:
        kwargs["json"] = materialize(copy.deepcopy(case["body"]), server)
    body = kwargs.get("json") or {}
    streamed = isinstance(body, dict) and body.get("stream") is True
    async with client.stream(case["method"], server.url + case["path"], **kwargs) as r:
        raw = await r.aread()
    return observe(case, body, r.status_code, r.headers, raw.decode("utf-8", "replace"), streamed)


async def observe_all(url: str, cases: list[dict], concurrency: int = 16) -> dict[str, dict]:
    """Every case's observation: the others concurrently, then the serial ones in order."""
    import httpx
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        server = await Server.discover(client, url)
        gate = asyncio.Semaphore(concurrency)

        async def one(case):
            async with gate:
                return case["id"], await send(client, server, case)
        out = dict(await asyncio.gather(*(one(c) for c in cases if not c.get("serial"))))
        for c in cases:
            if c.get("serial"):
                out[c["id"]] = await send(client, server, c)
    return out


# ---- observing -----------------------------------------------------------------------------------

def shape(value, fold: bool = False):
    """The JSON type tree of value; nulls dropped, list items as a set of kinds, and maps keyed by
    token (completions' top_logprobs entries, prompt_logprobs entries) folded to one key."""
    if isinstance(value, dict):
        items = {k: v for k, v in value.items() if v is not None and k not in VARYING}
        if fold:
            found = kinds(shape(v) for v in items.values())
            return {"<token>": found} if found else {}
        token_maps = {"prompt_logprobs"} | ({"top_logprobs"} if "tokens" in items else set())
        return {k: shape(v, k in token_maps) for k, v in sorted(items.items())}
    if isinstance(value, list):
        return ["list", kinds(shape(v, fold) for v in value if v is not None)]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "str"


def kinds(shapes) -> list:
    """The distinct shapes, sorted, less those another one covers (one that differs only by an
    empty list where the other has items: an empty list says nothing of its items' type)."""
    unique = {json.dumps(x, sort_keys=True): x for x in shapes}
    keep = [x for k, x in unique.items()
            if not any(k2 != k and covers(y, x) for k2, y in unique.items())]
    return sorted(keep, key=lambda x: json.dumps(x, sort_keys=True))


def covers(a, b) -> bool:
    """Whether shape a is shape b with some of b's empty lists holding items."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(covers(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list) and a[:1] == b[:1] == ["list"]:
        return not b[1] or (len(a[1]) == len(b[1]) and all(covers(x, y) for x, y in zip(a[1], b[1])))
    return a == b


def deterministic(body) -> bool:
    if not isinstance(body, dict):
        return False
    return body.get("temperature") == 0 or body.get("use_beam_search") is True or body.get("top_k") == 1


def _content(choices: list[dict], usage: dict | None, chat: bool) -> dict:
    out = {"texts": {}, "finish": {}}
    for ch in choices:
        i = str(ch["index"])
        text = (ch.get("message") or {}).get("content") if chat else ch.get("text")
        out["texts"][i] = text
        out["finish"][i] = ch.get("finish_reason")
    if usage:
        out["usage"] = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")}
    return out


def observe(case: dict, body, status: int, headers, text: str, streamed: bool) -> dict:
    obs: dict = {"status": status}
    for name in ("access-control-allow-origin", "access-control-allow-credentials"):
        if name in headers and "Origin" in (case.get("headers") or {}):
            obs[name] = headers[name]
    chat = case["path"].endswith("/chat/completions")
    ctype = headers.get("content-type", "")
    if status >= 400:
        try:
            err = json.loads(text).get("error", {})
            obs["error"] = {"fields": sorted(err), "code": err.get("code")}
        except (ValueError, AttributeError):
            obs["error"] = {"fields": [], "code": None}
        return obs
    if streamed and status == 200:
        obs["sse"] = sse_summary(text, ctype)
        if deterministic(body):
            obs["content"] = stream_content(text, chat)
        return obs
    if ctype.startswith("application/json"):
        try:
            data = json.loads(text)
        except ValueError:
            obs["body"] = "not json"
            return obs
        obs["shape"] = shape(data)
        if deterministic(body) and isinstance(data, dict) and "choices" in data:
            obs["content"] = _content(data["choices"], data.get("usage"), chat)
    return obs


def _events(text: str) -> tuple[list[str], bool]:
    """The data payloads of an SSE body, and whether its framing is right (each event one `data: `
    line followed by a blank line)."""
    blocks = text.split("\n\n")
    ok = text.endswith("\n\n")
    payloads = []
    for block in blocks[:-1] if ok else blocks:
        if not block:
            continue
        lines = block.split("\n")
        ok = ok and len(lines) == 1 and lines[0].startswith("data: ")
        payloads.append(lines[0][6:] if lines[0].startswith("data: ") else lines[0])
    return payloads, ok


def sse_summary(text: str, ctype: str) -> dict:
    payloads, framing_ok = _events(text)
    chunks = [json.loads(p) for p in payloads if p != "[DONE]" and p.startswith("{")]
    return {"content_type": ctype.split(";")[0], "framing_ok": framing_ok,
            "done_last": bool(payloads) and payloads[-1] == "[DONE]", "done_count": payloads.count("[DONE]"),
            "chunk_shapes": [json.dumps(k, sort_keys=True) for k in kinds(shape(c) for c in chunks)],
            "usage_chunk": bool(chunks) and chunks[-1].get("choices") == [] and "usage" in chunks[-1],
            "error_event": any("error" in c for c in chunks)}


def stream_content(text: str, chat: bool) -> dict:
    payloads, _ = _events(text)
    out = {"texts": {}, "finish": {}}
    for p in payloads:
        if p == "[DONE]" or not p.startswith("{"):
            continue
        chunk = json.loads(p)
        for ch in chunk.get("choices") or []:
            i = str(ch["index"])
            piece = ((ch.get("delta") or {}).get("content") if chat else ch.get("text")) or ""
            out["texts"][i] = out["texts"].get(i, "") + piece
            if ch.get("finish_reason") is not None:
                out["finish"][i] = ch["finish_reason"]
    return out


# ---- comparing -----------------------------------------------------------------------------------

def differences(a, b, path: str = "") -> list[str]:
    """Where a and b differ, one line per place (a: ours or the recording; b: the other)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            where = f"{path}.{k}" if path else k
            if k not in b:
                out.append(f"{where}: only in the first ({_short(a[k])})")
            elif k not in a:
                out.append(f"{where}: only in the second ({_short(b[k])})")
            else:
                out += differences(a[k], b[k], where)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2 and a[0] == b[0] == "list":
        if not a[1] or not b[1]:     # an empty list fits any item type
            return []
        return differences_in_sets(a[1], b[1], path + "[]")
    if path.endswith("chunk_shapes") and isinstance(a, list) and isinstance(b, list):
        return differences_in_sets([json.loads(x) for x in a], [json.loads(x) for x in b], path)
    return [] if a == b else [f"{path}: {_short(a)} != {_short(b)}"]


def differences_in_sets(a: list, b: list, path: str) -> list[str]:
    if a == b:
        return []
    if len(a) == 1 and len(b) == 1:
        return differences(a[0], b[0], path)
    # Several kinds of items (chunks): pair each with its closest on the other side.
    def key(x): return json.dumps(x, sort_keys=True)
    only_a = [x for x in a if key(x) not in {key(y) for y in b}]
    only_b = [y for y in b if key(y) not in {key(x) for x in a}]
    out = []
    while only_a and only_b:
        x, y = min(((x, y) for x in only_a for y in only_b), key=lambda xy: len(differences(*xy, path)))
        out += differences(x, y, path)
        only_a.remove(x)
        only_b.remove(y)
    if path.endswith("chunk_shapes"):
        # A router behind a stream merges its queued tokens into one chunk (services/router/
        # pacing.py; vLLM's does too): the chunks between the first and the last may then never
        # be sent, and a kind of chunk goes missing on that side. A kind is lost to a merge only
        # into a kind that holds all its fields; a kind of fields that no chunk on the other
        # side carries still counts.
        only_a = [x for x in only_a if not any(fits_within(x, y) for y in b)]
        only_b = [y for y in only_b if not any(fits_within(y, x) for x in a)]
    out += [f"{path}: a kind only in the first: {_short(x)}" for x in only_a]
    out += [f"{path}: a kind only in the second: {_short(y)}" for y in only_b]
    return out


def fits_within(small, big) -> bool:
    """Whether shape `small` is `big` less some fields (at any depth, list items included)."""
    if isinstance(small, dict) and isinstance(big, dict):
        return all(k in big and fits_within(v, big[k]) for k, v in small.items())
    if isinstance(small, list) and isinstance(big, list) and len(small) == len(big) == 2 \
            and small[0] == big[0] == "list":
        return all(any(fits_within(s, b) for b in big[1]) for s in small[1])
    return small == big


def _short(v) -> str:
    s = json.dumps(v, ensure_ascii=False, sort_keys=True)
    return s if len(s) <= 160 else s[:157] + "..."


def for_peer(obs: dict) -> dict:
    """An observation as compared with another server: less what we add everywhere on purpose
    (the README's list): system_fingerprint in every chunk (vLLM sends it in the last one only)."""
    sse = obs.get("sse")
    if not sse:
        return obs
    chunks = [{k: v for k, v in json.loads(c).items() if k != "system_fingerprint"} for c in sse["chunk_shapes"]]
    return {**obs, "sse": {**sse, "chunk_shapes": [json.dumps(k, sort_keys=True) for k in kinds(chunks)]}}


def peer_report(cases: list[dict], ours: dict[str, dict], peer: dict[str, dict]) -> tuple[list[str], list[str]]:
    return report(cases, {k: for_peer(v) for k, v in ours.items()}, {k: for_peer(v) for k, v in peer.items()}, True)


def report(cases: list[dict], first: dict[str, dict], second: dict[str, dict],
           honour_deliberate: bool) -> tuple[list[str], list[str]]:
    """(differences that count, differences on cases marked deliberate), as printable lines."""
    counted, deliberate = [], []
    for case in cases:
        cid = case["id"]
        diffs = differences(first.get(cid), second.get(cid)) if cid in first and cid in second else \
            [f"observed on {'the first' if cid in first else 'the second'} only"]
        lines = [f"{cid}: {d}" for d in diffs]
        if lines and honour_deliberate and case.get("deliberate"):
            deliberate += [f"{line}   [deliberate: {case['deliberate']}]" for line in lines]
        else:
            counted += lines
    return counted, deliberate


# ---- the command line ----------------------------------------------------------------------------

def record(url: str, path: Path = DATA_FILE, concurrency: int = 16) -> list[dict]:
    from pagedserve.loadgen.differential_cases import build_cases
    cases = build_cases()
    seen = asyncio.run(observe_all(url, cases, concurrency))
    for c in cases:
        c["expect"] = seen[c["id"]]
    write_cases(cases, path)
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["record", "check", "compare"])
    p.add_argument("--url", required=True, help="the server under test (ours)")
    p.add_argument("--peer-url", help="compare: the other server (vLLM)")
    p.add_argument("--cases", type=Path, default=DATA_FILE)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args(argv)
    if args.mode == "record":
        cases = record(args.url, args.cases, args.concurrency)
        print(f"recorded {len(cases)} cases into {args.cases}")
        return 0
    cases = load_cases(args.cases)
    ours = asyncio.run(observe_all(args.url, cases, args.concurrency))
    if args.mode == "check":
        counted, deliberate = report(cases, ours, {c["id"]: c["expect"] for c in cases}, False)
    else:
        if not args.peer_url:
            p.error("compare needs --peer-url")
        peer = asyncio.run(observe_all(args.peer_url, cases, args.concurrency))
        counted, deliberate = peer_report(cases, ours, peer)
    for line in deliberate + counted:
        print(line)
    print(f"{len(cases)} cases: {len(counted)} differences" + (f", {len(deliberate)} deliberate" if deliberate else ""))
    return 1 if counted else 0


if __name__ == "__main__":
    sys.exit(main())
