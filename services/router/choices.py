"""One choice of a request, as the router builds it from the scheduler's token deltas.

Owns the choice's token ids, its released text (after detokenizing and stop strings), its logprob
entries and its finish reason. Streaming and non-streaming responses are both made from the
ChoiceEvents this produces, so their texts are equal by construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.protocol import CompletionDelta
from pagedserve.services.router.detokenizer import IncrementalDetokenizer
from pagedserve.services.router.stop_strings import StopStrings


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None
    top: list                  # [(token id, logprob), ...] of the top alternatives
    text_offset: int           # where this token's text starts in the choice's text


@dataclass
class ChoiceEvent:
    """What changed in one choice with one update: text to send, tokens' logprobs, maybe the end."""
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_new_tokens: int = 0
    stop_reason: str | int | None = None     # the stop string or stop token id that ended it
    tokens_so_far: int = 0                   # the choice's tokens up to and with this event's

    def says_nothing(self) -> bool:
        """No token, no text, no end: nothing to send in a stream. A token whose text is not out
        yet (part of a character, or held for a stop string) is still a chunk, with "", as vLLM's."""
        return not self.num_new_tokens and not self.text and self.finish_reason is None

    def then(self, later: "ChoiceEvent") -> "ChoiceEvent":
        """This event and the same choice's next one, as one chunk's worth."""
        return ChoiceEvent(self.index, self.text + later.text, self.logprobs + later.logprobs,
                           later.finish_reason, self.num_new_tokens + later.num_new_tokens,
                           later.stop_reason, later.tokens_so_far)


class ChoiceState:
    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, stops: StopStrings,
                 eos_token_ids: set[int], stop_token_ids: set[int], min_tokens: int = 0,
                 keep_output: bool = True):
        self.index = index
        self.keep_output = keep_output     # False: the request only scores its prompt (echo, max_tokens 0)
        self.detok = detokenizer
        self.stops = stops
        # Tokens that end a sequence with "stop": EOS and stop_token_ids. Counted; shown only with
        # include_stop_str_in_output (as vLLM); a stop_token_id is the choice's stop_reason.
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = stop_token_ids
        self.min_tokens = min_tokens       # stop strings may end only in text of later tokens
        self.stop_token: int | None = None   # the stop_token_id that ended it
        self.token_ids: list[int] = []
        self.text = ""
        self.decoded_len = 0
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.cumulative_logprob = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's stop_reason: the stop string that ended the choice, else its stop token id."""
        return self.stops.matched if self.stops.matched is not None else self.stop_token

    def apply(self, delta: CompletionDelta) -> ChoiceEvent:
        if not self.keep_output:      # the engine's one token is not the client's: only its end is
            self.finish_reason = delta.finish_reason
            return ChoiceEvent(self.index, "", [], self.finish_reason)
        parts: list[str] = []
        new_lps: list[TokenLogprob] = []
        matched = False
        ids = delta.token_ids
        for k, tid in enumerate(ids):
            self.token_ids.append(tid)
            entry = TokenLogprob(tid, _at(delta.logprobs, k), [tuple(p) for p in (_at(delta.top_logprobs, k) or [])],
                                 self.decoded_len)
            self.logprobs.append(entry)
            new_lps.append(entry)
            if k == len(ids) - 1 and delta.finish_reason == "stop":
                if tid in self.stop_token_ids:
                    self.stop_token = tid
                if (tid in self.stop_token_ids or tid in self.eos_token_ids) and not self.stops.include:
                    continue
            piece = self.detok.push(tid)
            self.decoded_len += len(piece)
            out, matched = self.stops.feed(piece, len(self.token_ids) > self.min_tokens)
            parts.append(out)
            if matched:
                break      # tokens after the one that completed a stop string are dropped
        if matched:
            self.finish_reason = "stop"
        elif delta.finish_reason is not None:
            tail = self.detok.flush()
            self.decoded_len += len(tail)
            out, matched = self.stops.feed(tail)
            parts.append(out)
            if not matched:
                parts.append(self.stops.flush())
            self.finish_reason = "stop" if matched else delta.finish_reason
        self.cumulative_logprob = delta.cumulative_logprob
        text = "".join(parts)
        self.text += text
        return ChoiceEvent(self.index, text, new_lps, self.finish_reason, len(new_lps), self.stop_reason,
                           len(self.token_ids))

    def finish(self, reason: str) -> ChoiceEvent:
        """End the choice from the router's side (its request ended without a word on it)."""
        tail = self.detok.flush()
        out, matched = self.stops.feed(tail)
        text = out + ("" if matched else self.stops.flush())
        self.text += text
        self.finish_reason = "stop" if matched else reason
        return ChoiceEvent(self.index, text, [], self.finish_reason, 0, self.stop_reason, len(self.token_ids))


def _at(values, k):
    return values[k] if values is not None and k < len(values) else None
