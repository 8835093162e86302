"""When a stream's chunks go out: one per token (vLLM's default), or every --stream-interval tokens.

vLLM's rule, per choice: a chunk leaves when the choice's first token comes, when it ends, and
whenever `interval` tokens have gathered since the last chunk; between those its tokens wait
and go out together. With interval 1 every token is a chunk, its text "" when the text is not
out yet (part of a UTF-8 character, or held while it may begin a stop string).

A router that has fallen behind a stream (many of its updates queued while the last chunks were
being written) may merge each choice's queued tokens into one chunk to catch up; the caller says
when, and the tokens merged so are counted (pagedserve:stream_merged_tokens_total).
"""
from __future__ import annotations

from pagedserve.services.router.choices import ChoiceEvent

# Updates queued for one stream beyond which the router counts as behind it. On a quiet server a
# stream has one, at times two, queued when its task wakes; several means its client or the
# router's event loop is not keeping up, and merging spares the per-chunk work that fell behind.
BEHIND_UPDATES = 8


class StreamPacer:
    def __init__(self, interval: int = 1):
        self.interval = interval
        self.pending: dict[int, ChoiceEvent] = {}    # choice index -> tokens waiting for their chunk
        self.started: set[int] = set()                # choices whose first token has gone out

    def pace(self, events: list[ChoiceEvent], behind: bool = False) -> tuple[list[ChoiceEvent], int]:
        """(the events to send now, in order, and how many tokens were merged for being behind)."""
        merged = 0
        if behind:
            events, merged = merge_by_choice(events)
        out = []
        for ev in events:
            held = self.pending.pop(ev.index, None)
            if held is not None:
                ev = held.then(ev)
            if ev.finish_reason is not None or ev.index not in self.started or ev.num_new_tokens >= self.interval:
                if ev.num_new_tokens:
                    self.started.add(ev.index)
                out.append(ev)
            else:
                self.pending[ev.index] = ev
        return out, merged


def merge_by_choice(events: list[ChoiceEvent]) -> tuple[list[ChoiceEvent], int]:
    """Each choice's events as one, where its first one stood; and the tokens that lost a chunk."""
    first: dict[int, int] = {}
    out: list[ChoiceEvent] = []
    merged = 0
    for ev in events:
        at = first.get(ev.index)
        if at is None:
            first[ev.index] = len(out)
            out.append(ev)
        else:
            merged += ev.num_new_tokens if out[at].num_new_tokens else max(ev.num_new_tokens - 1, 0)
            out[at] = out[at].then(ev)
    return out, merged
