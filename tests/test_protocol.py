"""pagedserve.services.protocol (and its codec, protocol_codec): every message round-trips, and anything
malformed is a ProtocolError."""
import msgpack
import numpy as np
import pytest

from pagedserve.services import protocol, protocol_codec
from pagedserve.services.protocol import ProtocolError


def roundtrip(msg):
    return protocol.decode(protocol.encode(msg))


def raw(type_name: str, body: dict, version: int = protocol.VERSION) -> list[bytes]:
    return [msgpack.packb({"v": version, "t": type_name, "b": body}, use_bin_type=True)]


def test_every_message_round_trips():
    seqs = [protocol.SeqWork(3, [5, 6, 7], 0, [[3, "k", 0, 0, 0], [9, "k", 1, 0, 0]]),
            protocol.SeqWork(4, [8], 12, [])]
    results = [protocol.SampleResult(3, 17, -0.5, [[17, -0.5], [2, -1.5]]),
               protocol.SampleResult(9, 4, -1.25, None, [[4, -1.25]])]
    update = protocol.RequestUpdate("r1", [protocol.CompletionDelta(0, [1, 2], [-0.1, -0.2], None, "stop", -0.3)],
                                    True, None, 7, 0)
    for msg in (protocol.Ping("a", 1.5), protocol.Error("bad", 422, param="n"),
                protocol.AddRequest("r1", [1, 2, 3], {"n": 2}), protocol.RequestUpdates([update]),
                protocol.RequestUpdates([update], [protocol.TokenDelta("r2", 9, -0.5, -2.0),
                                                   protocol.TokenDelta("r3", 4, 0, -1.0)]),
                protocol.ApplyOps(3, [["append_tokens", [1, 2], [5, 6]], ["free", 4]]),
                protocol.ApplyOpsReply(3, [[True, 0], None]),
                protocol.ExecuteStep(1, seqs, {3: [0, 11]}, [2], {"k": {"n": 2}}, ["old"], {9: [[1], [2]]}),
                protocol.ExecuteStep(2, []), protocol.StepResult(1, results, None, 0.01),
                protocol.StepResult(2, [], "model error")):
        assert roundtrip(msg) == msg


def test_step_lists_travel_as_columns():
    frames = protocol.encode(protocol.ExecuteStep(1, [protocol.SeqWork(3, [5], 0), protocol.SeqWork(4, [6, 7], 1)]))
    body = msgpack.unpackb(frames[0], strict_map_key=False)["b"]
    assert body["seqs"] == {"seq_id": [3, 4], "token_ids": [[5], [6, 7]], "start_pos": [0, 1], "samples": [[], []]}


def test_arrays_travel_as_frames():
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    frames = [b""]
    wire = protocol_codec._to_wire(arr, frames)
    assert len(frames) == 2 and wire == {"__array__": 1, "dtype": "<i4", "shape": [3, 4]}
    assert np.array_equal(protocol_codec._from_wire(wire, frames), arr)
    with pytest.raises(ProtocolError, match="bad array frame"):
        protocol_codec._from_wire({"__array__": 1, "dtype": "<i4", "shape": [5, 5]}, frames)


SEQS_OK = {"seq_id": [1, 2], "token_ids": [[5], [6]], "start_pos": [0, 0], "samples": [[], []]}


@pytest.mark.parametrize("frames, match", [
    ([], "empty"),
    ([b"\xc1garbage"], "undecodable"),
    ([msgpack.packb([1, 2])], "header must be a map"),
    (raw("Ping", {}, version=1), "version 1 not supported"),
    (raw("Nope", {}), "unknown message type"),
    (raw("AbortRequest", {}), "missing field 'request_id'"),
    (raw("AbortRequest", {"request_id": 5}), "request_id"),
    (raw("AbortRequest", {"request_id": "r", "extra": 1}), "unknown fields"),
    (raw("AddRequest", {"request_id": "r", "prompt_token_ids": [1, "2"], "params": {}}), "prompt_token_ids"),
    (raw("AddRequest", {"request_id": "r", "prompt_token_ids": [1, True], "params": {}}), "prompt_token_ids"),
    (raw("ExecuteStep", {"step": 1, "seqs": dict(SEQS_OK, start_pos=[0])}), "bad column 'start_pos'"),
    (raw("ExecuteStep", {"step": 1, "seqs": dict(SEQS_OK, token_ids=[[5], [6.5]])}), "bad column 'token_ids'"),
    (raw("ExecuteStep", {"step": 1, "seqs": dict(SEQS_OK, token_ids=[[5], 6])}), "bad column 'token_ids'"),
    (raw("ExecuteStep", {"step": 1, "seqs": dict(SEQS_OK, seq_id=[1, None])}), "bad column 'seq_id'"),
    (raw("ExecuteStep", {"step": 1, "seqs": dict(SEQS_OK, colour=[1, 2])}), "unknown columns"),
    (raw("ExecuteStep", {"step": 1, "seqs": {k: v for k, v in SEQS_OK.items() if k != "start_pos"}}),
     "missing column 'start_pos'"),
    (raw("ExecuteStep", {"step": 1, "seqs": [{"seq_id": 1, "token_ids": [5], "start_pos": 0}]}), "seqs"),
    (raw("StepResult", {"step": 1, "results": {"seq_id": [1], "token_id": ["x"]}}), "bad column 'token_id'"),
    (raw("StepResult", {"step": 1, "results": {"seq_id": [1], "logprob": [0.5, 0.1]}}), "bad column 'logprob'"),
])
def test_malformed_messages_are_protocol_errors(frames, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(frames)


def test_nested_messages_travel_as_rows_and_may_leave_out_defaults():
    frames = protocol.encode(protocol.RequestUpdates([protocol.RequestUpdate("r", [protocol.CompletionDelta(0, [5])])]))
    body = msgpack.unpackb(frames[0])["b"]
    assert body["updates"] == [["r", [[0, [5], [], None, None, 0.0]], False, None, 0, 0, None, 0.0, 0.0, 0.0, 0.0, 0, 0, False]]
    short = protocol.decode(raw("RequestUpdates", {"updates": [["r", [[1, [7]]]]]}))
    assert short == protocol.RequestUpdates([protocol.RequestUpdate("r", [protocol.CompletionDelta(1, [7])])])


@pytest.mark.parametrize("updates, match", [
    ([{"request_id": "r", "outputs": []}], "updates"),
    ([["r"]], "1 values for 14 fields"),
    ([[5, []]], "request_id"),
    ([["r", [[0, [1], [], None, None, 0.0, 99]]]], "7 values for 6 fields"),
    ([["r", [[0, ["x"]]]]], "token_ids"),
    ([["r", [{"index": 0}]]], "outputs"),
    ([["r", [], "yes"]], "finished"),
])
def test_malformed_rows_are_protocol_errors(updates, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(raw("RequestUpdates", {"updates": updates}))


def test_optional_columns_take_their_defaults():
    msg = protocol.decode(raw("StepResult", {"step": 1, "results": {"seq_id": [1, 2], "token_id": [5, 6]}}))
    assert msg.results == [protocol.SampleResult(1, 5), protocol.SampleResult(2, 6)]


def test_columns_built_by_the_sender_encode_like_the_items():
    items = [protocol.SeqWork(3, [5], 0, [[3, "k", 0, 0, 0]]), protocol.SeqWork(4, [6, 7], 9, [])]
    columns = protocol.Columns(protocol.SeqWork, {"seq_id": [3, 4], "token_ids": [[5], [6, 7]],
                                                  "start_pos": [0, 9], "samples": [[[3, "k", 0, 0, 0]], []]})
    assert len(columns) == 2
    as_columns, as_items = protocol.ExecuteStep(1, columns), protocol.ExecuteStep(1, items)
    assert protocol.encode(as_columns) == protocol.encode(as_items)
    assert protocol.decode(protocol.encode(as_columns)) == as_items
    empty = protocol.RequestUpdates([], protocol.Columns(protocol.TokenDelta, {"request_id": [], "token_id": []}))
    assert protocol.decode(protocol.encode(empty)) == protocol.RequestUpdates([], [])
