"""The step loop both engine clients share: one guarded ``engine.step()`` and after it the step's news
(tokens and ends of the requests it ran), read from the engine's requests instead of a per-token callback.
Runs on the engine's side: the server's engine thread, or the engine process."""
from __future__ import annotations

import contextlib
import itertools
import logging

from tritune.model.serve.client import error_text

log = logging.getLogger("tritune.serve")


class StepCollector:
    """What both engine loops keep between two steps (the server's engine thread,
    :class:`tritune.model.serve.thread.ThreadEngineClient`, and the engine process's loop in
    :mod:`tritune.model.serve.proc`): the requests accepted and not ended (``live``, by engine request id),
    one guarded step, and after it the step's news.

    No stream callback: the engine would call one per token (4096 Python calls for a 16-step run of 256
    sequences). After a step the collector reads each running request's ``output_ids`` past what it has
    handed over (``sent``), and the ends from the requests ``step()`` returned: a few operations per
    request per step. A record needs ``id`` (the engine's request id), ``req`` (the engine's request) and
    ``sent``; the subclass says what happens to news (``_tokens``, ``_ended``)."""

    def __init__(self, engine):
        self.engine = engine
        self.live: dict = {}
        self.steps = 0
        self._failures = 0

    def step_once(self) -> None:
        """One ``engine.step()``; a failing step ends its own requests (the engine does), and three failures
        in a row (failing before it took any request) end every live request instead of hanging them."""
        try:
            finished = self.engine.step()
            self._failures = 0
        except Exception as e:  # noqa: BLE001 (the step's requests end with the error; others go on)
            log.exception("engine step failed; the requests of that step end with an error")
            finished = None     # which requests it ended: every live one is looked at
            self._failures += 1
            if self._failures >= 3:
                self._fail_all(error_text(e))
        self.steps += 1
        self._collect(finished)

    def _stepped(self, finished):
        """The requests a step may have news of: the running ones and those the step returned as finished
        (every live one after a failed step)."""
        if isinstance(finished, list):
            return itertools.chain(self.engine.scheduler.running, finished)
        return [r.req for r in list(self.live.values())]

    def _collect(self, finished) -> None:
        """The step's tokens and ends: the running requests and those the step returned as finished (all
        live ones after a failed step)."""
        live = self.live
        if not live:
            return
        for req in self._stepped(finished):
            r = live.get(req.id)
            if r is None:
                continue
            out = req.output_ids
            if len(out) > r.sent:
                self._tokens(r, out[r.sent:])
                r.sent = len(out)
            if req.finish_reason is not None:
                self._end(r, req.finish_reason, None if req.error is None else error_text(req.error))

    def _end(self, r, finish: str, error: str | None) -> None:
        self.live.pop(r.id, None)
        self._ended(r, finish, error, len(r.req.output_ids) if r.req is not None else 0)

    def _abort(self, rid) -> None:
        """The engine's abort of a live request, its end handed over at once."""
        r = self.live.get(rid)
        if r is None:
            return
        with contextlib.suppress(KeyError):     # it finished in the meantime (its end is collected)
            self.engine.abort(rid)
            self._end(r, "abort", None)

    def _fail_all(self, error: str) -> None:
        for r in list(self.live.values()):
            with contextlib.suppress(Exception):    # ending it here regardless
                self.engine.abort(r.id)
            self._end(r, "error", error)

    def _tokens(self, r, tokens: list) -> None:
        raise NotImplementedError

    def _ended(self, r, finish: str, error: str | None, n_out: int) -> None:
        raise NotImplementedError
