"""The router's pure parts: incremental detokenizing, stop-string hold-back, replica picking."""
from __future__ import annotations

import random

import pytest

from pagedserve.services.router.detokenizer import IncrementalDetokenizer, TokenTexts, fast_decoder
from pagedserve.services.router.replicas import pick_replica, prefix_key
from pagedserve.services.router.stop_strings import StopStrings
from pagedserve.services.state import Replica


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)


def test_incremental_detokenizing_equals_a_batch_decode(tokenizer):
    decode = fast_decoder(tokenizer)
    rng = random.Random(0)
    texts = ["naïve café — 日本語 ok €€ 🙂 done", "def f(x):\n    return x ** 2  # ünïcödé"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the test needs split characters"
        prompt = tokenizer("prompt text")["input_ids"]
        detok = IncrementalDetokenizer(decode, prompt, skip_special_tokens=True)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
    # Random ids (incomplete characters included, special tokens too): still the batch decode, but
    # for a character the end cut off, which is dropped (as vLLM) instead of shown as U+FFFD.
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(decode, [1], skip_special_tokens=skip)
            got = "".join(detok.push(i) for i in ids) + detok.flush()
            assert got == tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")


def test_a_character_cut_off_by_the_end_is_dropped(tokenizer):
    decode = fast_decoder(tokenizer)
    ids = tokenizer("ok €", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(decode, [1])
    pieces = [detok.push(i) for i in ids[:-1]] + [detok.flush()]   # the last byte of "€" never came
    assert "".join(pieces) == "ok " and "\ufffd" not in "".join(pieces)


def test_a_token_holding_part_of_a_character_has_no_text_but_its_own_bytes(tokenizer):
    """Logprob tokens and top-logprob keys as vLLM shows them: "" rather than U+FFFD."""
    texts = TokenTexts(fast_decoder(tokenizer), tokenizer)
    euro = tokenizer("€", add_special_tokens=False)["input_ids"]
    assert len(euro) > 1                                   # split over tokens in this vocabulary
    assert [texts.text(i) for i in euro] == [""] * len(euro)
    assert bytes(b for i in euro for b in texts.bytes(i)) == "€".encode()
    ok = tokenizer("ok", add_special_tokens=False)["input_ids"][0]
    assert texts.text(ok) == tokenizer.decode([ok]) and texts.bytes(ok) == list(texts.text(ok).encode())


def _stream(stops, pieces, include=False):
    s = StopStrings(stops, include)
    out, matched = [], False
    for p in pieces:
        text, matched = s.feed(p)
        out.append(text)
        if matched:
            break
    if not matched:
        out.append(s.flush())
    return out, matched


def test_stop_strings_hold_back_and_cut():
    assert _stream(["world"], ["hello wo", "rld and more"]) == (["hello ", ""], True)
    assert _stream(["world"], ["hello wo", "rld"], include=True) == (["hello ", "world"], True)
    # A held tail that turns out not to be a stop is released.
    assert "".join(_stream(["world"], ["hello wo", "nder"])[0]) == "hello wonder"
    assert "".join(_stream(["world"], ["hello wo"])[0]) == "hello wo"
    # The earliest of several stops wins; overlapping prefixes are handled.
    assert "".join(_stream(["abc", "b"], ["xab", "c"])[0]) == "xa"
    assert "".join(_stream(["aab"], ["a", "a", "a", "b", "z"])[0]) == "a"


def test_stop_strings_never_emit_any_part_of_a_stop_under_random_splits():
    rng = random.Random(1)
    alphabet = "ab c"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 6)))) if len(text) > 1 else []
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, matched = _stream(stops, pieces)
        found = [text.find(s) for s in stops if s in text]
        expected = text[:min(found)] if found else text
        assert "".join(out) == expected and matched == bool(found), (text, stops, pieces, out)
        emitted = ""
        for piece in out:
            emitted += piece
            assert emitted == expected[:len(emitted)]


def test_pick_replica_prefers_the_cached_prefix_while_loads_are_close():
    reps = [Replica(f"r{i}", f"tcp://h:{i}") for i in range(4)]
    key = prefix_key(list(range(16)))
    assert prefix_key(list(range(15))) is None
    loads = {r.id: 1.0 for r in reps}
    chosen = pick_replica(reps, loads, key)
    assert all(pick_replica(reps, loads, key) == chosen for _ in range(3)), "deterministic"
    assert pick_replica(list(reversed(reps)), loads, key) == chosen, "independent of list order"
    # Same prefix -> same replica under small load differences...
    loads[chosen.id] = 2.5
    assert pick_replica(reps, loads, key) == chosen
    # ...but not when it is much busier than the others.
    loads[chosen.id] = 50
    assert pick_replica(reps, loads, key) != chosen
    # Different prefixes spread over the replicas; without a prefix the least loaded wins.
    spread = {pick_replica(reps, {r.id: 0 for r in reps}, prefix_key([k] * 16)).id for k in range(40)}
    assert len(spread) >= 3
    assert pick_replica(reps, {"r0": 5, "r1": 0, "r2": 3, "r3": 9}, None).id == "r1"
    with pytest.raises(ValueError):
        pick_replica([], {}, None)


def test_a_buffered_subscriber_gets_one_merged_update_at_the_end():
    import asyncio
    from pagedserve.services import protocol
    from pagedserve.services.router.scheduler_client import Buffered, SchedulerClient
    client = SchedulerClient("tcp://127.0.0.1:1", "r0", ctx=None)
    queue: asyncio.Queue = asyncio.Queue()
    client.subscribe("a", queue, buffered=True)
    client._dispatch(protocol.RequestUpdates([], [protocol.TokenDelta("a", 5, -0.5, -0.5)]))
    client._dispatch(protocol.RequestUpdates([], [protocol.TokenDelta("a", 6, -0.25, -0.75)]))
    assert queue.empty()
    client._dispatch(protocol.RequestUpdates([protocol.RequestUpdate("a", [
        protocol.CompletionDelta(0, [7], [-1.0], [[[7, -1.0], [2, -3.0]]], None, -1.75),
        protocol.CompletionDelta(1, [9], [-2.0], None, None, -2.0)], num_cached_tokens=16)]))
    assert queue.empty()
    client._dispatch(protocol.RequestUpdate("a", [protocol.CompletionDelta(0, [8], [-0.5], None, "length", -2.25),
                                                  protocol.CompletionDelta(1, [], [], None, "stop", -2.0)],
                                            True, None, 4, 0))
    msg = queue.get_nowait()
    assert isinstance(msg, Buffered) and queue.empty() and "a" not in client.subscribers
    zero, one = msg.update.outputs
    assert zero.token_ids == [5, 6, 7, 8] and zero.logprobs == [-0.5, -0.25, -1.0, -0.5]
    assert zero.top_logprobs == [[], [], [[7, -1.0], [2, -3.0]], []]       # padded where none came
    assert (zero.finish_reason, zero.cumulative_logprob) == ("length", -2.25)
    assert one.token_ids == [9] and one.finish_reason == "stop"
    assert msg.update.finished and msg.update.num_prompt_tokens == 4 and msg.update.num_cached_tokens == 16
    assert msg.first_token_at <= msg.last_token_at


def test_errors_reach_a_buffered_subscriber_at_once():
    import asyncio
    from pagedserve.services import protocol
    from pagedserve.services.router.scheduler_client import SchedulerClient
    client = SchedulerClient("tcp://127.0.0.1:1", "r0", ctx=None)
    queue: asyncio.Queue = asyncio.Queue()
    client.subscribe("a", queue, buffered=True)
    client._dispatch(protocol.RequestUpdates([], [protocol.TokenDelta("a", 5)]))
    client._dispatch(protocol.Error("no room", 400, request_id="a"))
    assert isinstance(queue.get_nowait(), protocol.Error) and "a" not in client.merging


def test_a_dead_scheduler_fails_buffered_subscribers_and_forgets_their_updates():
    import asyncio
    from pagedserve.services import protocol
    from pagedserve.services.router.scheduler_client import Failure, SchedulerClient
    client = SchedulerClient("tcp://127.0.0.1:1", "r0", ctx=None)
    queue: asyncio.Queue = asyncio.Queue()
    client.subscribe("a", queue, buffered=True)
    client._dispatch(protocol.RequestUpdates([], [protocol.TokenDelta("a", 5)]))
    client.fail_all(503, "gone")
    assert isinstance(queue.get_nowait(), Failure) and not client.merging and not client.subscribers


def test_updates_that_queued_up_come_out_as_one_batch_and_a_failure_after_them(tokenizer):
    import asyncio
    from types import SimpleNamespace
    from pagedserve.services import protocol
    from pagedserve.services.router.errors import APIError
    from pagedserve.services.router.generation import Generation
    from pagedserve.services.router.scheduler_client import Failure
    from pagedserve.services.sampling_params import SamplingParams
    from pagedserve.services.router.metrics import RouterMetrics
    ctx = SimpleNamespace(info=SimpleNamespace(eos_token_ids=[]), decode=tokenizer.decode, metrics=RouterMetrics("m"))
    gen = Generation(ctx, "a", [[5, 6]], SamplingParams(max_tokens=8))
    gen.abort = gen.close = lambda *a: None        # no backend: nothing to abort or record
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    for tid in ids:
        gen.queue.put_nowait(protocol.RequestUpdate(gen.backend_ids[0],
                                                    [protocol.CompletionDelta(0, [tid], [-1.0], None, None, -1.0)]))
    gen.queue.put_nowait(Failure(503, "gone"))

    async def follow():
        batches = []
        with pytest.raises(APIError):
            async for batch in gen.events():
                batches.append(batch)
        return batches

    batches = asyncio.run(follow())
    assert len(batches) == 1 and len(batches[0]) == len(ids)
    assert "".join(e.text for e in batches[0]) == gen.choices[0][0].text and "two" in gen.choices[0][0].text


@pytest.mark.parametrize("unservable, status", [(False, 503), (True, 400)])
def test_an_engine_error_no_retry_mends_is_a_400(tokenizer, unservable, status):
    """A request the scheduler ends because it cannot fit the KV cache even alone comes back
    unservable: the client gets a 400 (fewer choices or tokens may fit), not a retryable 503."""
    import asyncio
    from types import SimpleNamespace
    from pagedserve.services import protocol
    from pagedserve.services.router.errors import APIError
    from pagedserve.services.router.generation import Generation
    from pagedserve.services.sampling_params import SamplingParams
    from pagedserve.services.router.metrics import RouterMetrics
    ctx = SimpleNamespace(info=SimpleNamespace(eos_token_ids=[]), decode=tokenizer.decode, metrics=RouterMetrics("m"))
    gen = Generation(ctx, "a", [[5, 6]], SamplingParams(max_tokens=8))
    gen.abort = gen.close = lambda *a: None
    gen.queue.put_nowait(protocol.RequestUpdate(gen.backend_ids[0], [], True, "does not fit in the KV cache",
                                                unservable=unservable))

    async def follow():
        async for _ in gen.events():
            pass
    with pytest.raises(APIError) as e:
        asyncio.run(follow())
    assert e.value.status == status and "KV cache" in str(e.value)


def test_text_of_the_first_min_tokens_can_start_a_stop_string_but_not_end_one():
    stops = StopStrings(["ab", "xyz"])
    assert stops.feed("ab", can_stop=False) == ("", False)         # complete but too early: held
    assert stops.feed("xa", can_stop=False) == ("abx", False)      # "a" may start "ab": held
    assert stops.feed("b") == ("", True) and stops.matched == "ab"  # ends in allowed text
    stops = StopStrings(["xyz"])
    assert stops.feed("xy", can_stop=False) == ("", False)
    assert stops.feed("q") == ("xyq", False)


def test_stop_reason_is_the_stop_token_id_and_its_text_shows_only_when_asked(tokenizer):
    from pagedserve.services import protocol
    from pagedserve.services.router.choices import ChoiceState
    ids = tokenizer.encode("one two", add_special_tokens=False)
    for include in (False, True):
        choice = ChoiceState(0, IncrementalDetokenizer(tokenizer.decode, [5], True), StopStrings([], include),
                             eos_token_ids={2}, stop_token_ids={ids[-1]})
        event = choice.apply(protocol.CompletionDelta(0, ids, [-1.0] * len(ids), None, "stop", -2.0))
        assert event.finish_reason == "stop" and event.stop_reason == ids[-1] == choice.stop_reason
        assert (choice.text == tokenizer.decode(ids)) is include
    eos = ChoiceState(0, IncrementalDetokenizer(tokenizer.decode, [5], True), StopStrings([]), {2}, set())
    assert eos.apply(protocol.CompletionDelta(0, [2], [-1.0], None, "stop", -1.0)).stop_reason is None
