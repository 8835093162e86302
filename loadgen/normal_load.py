"""The well-behaved clients of the attack soak: a steady, open-loop load through the openai SDK
(chat and completions, some streamed, some constrained by a small json_schema), one key.

It runs in a process of its own (LoadProcess): the attackers build and read bodies of many
megabytes with json, which holds the GIL for a third of a second at a time; in the same process
that stall was measured as the server's (a 600 ms p99 TTFT under attack against 27 ms quiet).

Open loop (one request every 1/rate s, whatever the server does) so that a stalled server shows
as failures and late first tokens, not as a client that politely slowed down. The SDK's retries
are off: a request the server dropped or refused counts as a failure, as a user would see it.
"""
from __future__ import annotations

import asyncio
import collections
import math
import multiprocessing
import random
import time
from dataclasses import dataclass, field

import openai

KINDS = ("chat_stream", "completion_stream", "chat_schema", "completion")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Scheduler:", "while True:", "# A paged KV cache"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


@dataclass
class Phase:
    """One run of the load: what every request ended as, and the TTFT of the streamed ones."""
    name: str
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    ttft_ms: list[float] = field(default_factory=list)      # a stream that failed first: inf
    failures: list[str] = field(default_factory=list)       # the first few, for the report

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    @property
    def success(self) -> float:
        return self.outcomes["ok"] / self.total if self.total else 0.0

    def ttft_p(self, q: float) -> float | None:
        if not self.ttft_ms:
            return None
        xs = sorted(self.ttft_ms)
        x = xs[min(len(xs) - 1, int(q / 100 * len(xs)))]
        return round(x, 1) if math.isfinite(x) else None

    def summary(self) -> dict:
        return {"requests": self.total, "outcomes": dict(self.outcomes), "success": round(self.success, 5),
                "ttft_p50_ms": self.ttft_p(50), "ttft_p99_ms": self.ttft_p(99), "streamed": len(self.ttft_ms),
                "streams_without_first_token": sum(1 for x in self.ttft_ms if not math.isfinite(x)),
                "failures": self.failures}


class NormalLoad:
    def __init__(self, url: str, key: str, model: str, rate: float, seed: int, timeout_s: float = 30.0):
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout_s)
        self.model, self.rate, self.rng = model, rate, random.Random(seed)

    async def run(self, phase: Phase, duration_s: float) -> Phase:
        tasks, start = [], time.monotonic()
        for i in range(int(duration_s * self.rate)):
            await asyncio.sleep(max(0.0, start + i / self.rate - time.monotonic()))
            tasks.append(asyncio.create_task(self.one(phase, self.rng.choice(KINDS), self.rng.choice(PROMPTS))))
        await asyncio.gather(*tasks)
        return phase

    async def one(self, phase: Phase, kind: str, prompt: str) -> None:
        try:
            t = time.perf_counter()
            if kind.endswith("_stream"):
                await self.streamed(phase, kind, prompt, t)
            elif kind == "chat_schema":
                r = await self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=48,
                    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
                assert r.choices and r.choices[0].message.content is not None
            else:
                r = await self.client.completions.create(model=self.model, prompt=prompt, max_tokens=16)
                assert r.choices
            outcome = "ok"
        except openai.APIStatusError as e:
            outcome = f"http_{e.status_code}"
            self.note(phase, kind, f"{e.status_code} {str(e.message)[:120]}")
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            outcome = type(e).__name__
            self.note(phase, kind, f"{type(e).__name__}: {e}"[:160])
        except openai.APIError as e:        # an error event inside a stream that had begun
            outcome = "stream_error"
            self.note(phase, kind, str(e)[:160])
        except AssertionError:
            outcome = "empty"
        phase.outcomes[outcome] += 1

    async def streamed(self, phase: Phase, kind: str, prompt: str, t: float) -> None:
        """TTFT: until the first chunk that carries text (a chat's role-only chunk does not); the
        stream is read to its end. A stream with no first token counts as an infinite TTFT (its
        placeholder: all are alike, so the first one found is replaced)."""
        phase.ttft_ms.append(math.inf)
        if kind == "chat_stream":
            stream = await self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=24, stream=True)
        else:
            stream = await self.client.completions.create(model=self.model, prompt=prompt, max_tokens=24,
                                                          stream=True)
        first = None
        async for chunk in stream:
            c = chunk.choices[0] if chunk.choices else None
            if first is None and c is not None and (c.delta.content if kind == "chat_stream" else c.text):
                first = time.perf_counter()
                phase.ttft_ms[phase.ttft_ms.index(math.inf)] = (first - t) * 1000
        assert first is not None

    @staticmethod
    def note(phase: Phase, kind: str, what: str) -> None:
        if len(phase.failures) < 10:
            phase.failures.append(f"{kind}: {what}")

    async def close(self) -> None:
        await self.client.close()


class LoadProcess:
    """The load's phases (warmup, quiet, attack) in a child process; the parent learns when each
    begins and gets each phase's summary. Spawned, not forked: the parent runs an event loop."""

    def __init__(self, url: str, key: str, model: str, rate: float, seed: int, durations: dict[str, float]):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_load_main, args=(child, url, key, model, rate, seed, durations),
                                name="normal-load", daemon=True)
        self.proc.start()
        child.close()       # the child's end stays open only there: its death is an EOF here

    async def begun(self, name: str) -> None:
        """Returns when phase `name` has begun."""
        await self._expect("begin", name)

    async def ended(self, name: str) -> dict:
        """Phase `name`'s summary, when it has ended."""
        return await self._expect("end", name)

    async def _expect(self, event: str, name: str):
        try:
            got = await asyncio.to_thread(self.conn.recv)
        except EOFError:
            await asyncio.to_thread(self.proc.join, 5)
            raise RuntimeError(f"the normal load's process ended (exit code {self.proc.exitcode})") from None
        assert got[:2] == (event, name), f"the normal load sent {got[:2]}, not {(event, name)}"
        return got[2]

    def close(self) -> None:
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
        self.conn.close()


def _load_main(conn, url: str, key: str, model: str, rate: float, seed: int, durations: dict[str, float]) -> None:
    async def phases() -> None:
        load = NormalLoad(url, key, model, rate, seed)
        try:
            for name, seconds in durations.items():
                conn.send(("begin", name, None))
                phase = await load.run(Phase(name), seconds)
                conn.send(("end", name, phase.summary()))
        finally:
            await load.close()
    asyncio.run(phases())
    conn.close()
