"""pagedserve.services.process: the peer watch that notices a silent scheduler."""
from __future__ import annotations

import logging

from pagedserve.services.process import PeerWatch


def test_peer_watch_reports_silence_once_and_recovery(caplog):
    now = [0.0]
    watch = PeerWatch("scheduler", logging.getLogger("t"), silent_after_s=5, clock=lambda: now[0])
    assert watch.check()                   # never heard: nothing to miss yet
    watch.seen()
    now[0] = 4.0
    assert watch.check()
    now[0] = 6.0
    with caplog.at_level(logging.INFO):
        assert not watch.check() and not watch.check()
        watch.seen()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("silent" in m for m in messages) == 1 and any("back" in m for m in messages)
