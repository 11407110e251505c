"""Continuous batching: which sequences run in the next step, and what they write where.

Each :meth:`Scheduler.schedule` call walks the running sequences in policy order: one decode token for
each, or, for a sequence still prefilling in chunks, its next chunk; then it admits waiting requests in
policy order while blocks, ``max_num_seqs`` and the step's token budget (``max_num_batched_tokens``)
allow; a request added between steps joins at the next one.

- Policies (``policy``): ``"fcfs"`` (arrival order), ``"priority"`` (lower ``priority`` first, then
  arrival) and ``"spf"`` (shortest prompt first, then arrival). The policy orders the queue, and the
  running sequences: when a running sequence needs a new block and none is free, the *last* running one
  in policy order is preempted: its blocks go back to the pool and it waits in the queue, keeping the
  tokens it generated, to be recomputed later (prompt + generated). The first in policy order is never
  preempted for another, so it always advances.
- Prefix caching (``enable_prefix_caching``, on by default; see :mod:`~tritune.model.engine.kv_cache`): an
  admitted request starts with the cached blocks matching its tokens and computes only the rest (at
  least its last token, whose logits it needs). A recomputed, preempted request usually finds its own.
- Chunked prefill (``enable_chunked_prefill``): a prompt longer than what is left of the step's budget is
  computed a chunk per step, in the same steps as the decodes (which come first: they are never held
  up by a long prompt), and samples its first token only with its last chunk.
  ``long_prefill_token_threshold`` caps one prompt's chunk per step (as vLLM's option of that name): the
  engine's device-side step takes prefill rows only up to a few dozen a step, so chunks that small keep
  every step of a long prompt on it, and the decodes beside it at their pace.

The model sees a :class:`SchedulerOutput`: prefills (the tokens computed this step, from ``start``, with
their cache slots; positions before ``start`` are in the cache) and decodes (each sequence's last token,
its slot, its block table), then hands the sampled tokens back to :meth:`Scheduler.update`, which
appends them, streams them, and retires finished sequences at once.
"""
from __future__ import annotations

import bisect
import itertools
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tritune.model.engine.kv_cache import BlockPool, BlockTable

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
POLICIES = ("fcfs", "priority", "spf")


class ContextLimitError(ValueError):
    """A request that does not fit the model's context: prompt + max_new_tokens > n_positions (the one
    rule of the engine, ``tritune generate`` and the server). It keeps the numbers, so each front end
    names the fix in its own terms (:meth:`describe`: ``max_new_tokens=`` / ``truncate=True`` here,
    ``--max-new-tokens`` / ``--truncate`` on the command line)."""

    def __init__(self, prompt_len: int, max_new_tokens: int, n_positions: int, truncate: bool = False):
        self.prompt_len, self.max_new_tokens, self.n_positions = prompt_len, max_new_tokens, n_positions
        self.truncate = truncate
        super().__init__(self.describe())

    def describe(self, max_new=lambda n: f"max_new_tokens={n}", truncate: str = "truncate=True") -> str:
        P, N, C = self.prompt_len, self.max_new_tokens, self.n_positions
        if self.truncate and N >= C:
            return (f"{max_new(N)} leaves no room for the prompt in the model's context of {C} tokens "
                    f"(n_positions); the most is {max_new(C - 1)}")
        what = (f"the prompt of {P} tokens is longer than the model's context of {C} tokens (n_positions)"
                if P > C else
                f"the prompt of {P} tokens + {max_new(N)} exceeds the model's context of {C} tokens (n_positions)")
        fixes = ([f"lower it to {max_new(C - P)}"] if P < C else []) + ["shorten the prompt"]
        if not self.truncate and N < C:
            fixes.append(f"pass {truncate} to keep the prompt's last {C - N} tokens")
        return f"{what}; " + ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy.

    ``stop`` strings need the tokenizer, so the engine checks them (and calls ``Scheduler.finish``);
    the scheduler itself stops on EOS, ``stop_token_ids`` and ``max_new_tokens``.
    """
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0                  # 0: no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))


@dataclass(eq=False)
class Request:
    id: Any
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    arrival_time: float
    stream: Any = None              # callable(request, token | None), or a queue (.put(token), None at the end)
    state: str = WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop" (EOS, stop token or string), "length", "abort", "error"
    error: BaseException | None = None
    truncated: int = 0              # prompt tokens dropped from the left (truncate=True)
    num_computed: int = 0           # tokens whose K/V are in the cache
    table: BlockTable | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    order: int = 0                  # arrival order: the larger, the newer
    priority: int = 0               # policy "priority": the lower, the sooner
    num_cached_tokens: int = 0      # prompt tokens found in the prefix cache at (the last) admission

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state == FINISHED


@dataclass
class SchedulerOutput:
    """One step's work. Prefills first, then decodes: ``update`` takes the sampled tokens of
    :attr:`requests` (the prefills that end their sequence's prompt, then the decodes) in that order."""
    prefill: list[Request] = field(default_factory=list)
    prefill_ids: list[list[int]] = field(default_factory=list)     # the tokens computed, from start
    prefill_slots: list[list[int]] = field(default_factory=list)   # their cache slots
    prefill_starts: list[int] = field(default_factory=list)        # position of the first (earlier: cached)
    prefill_tables: list[BlockTable] = field(default_factory=list)
    prefill_sample: list[bool] = field(default_factory=list)       # the last chunk: a token is sampled
    decode: list[Request] = field(default_factory=list)
    decode_ids: list[int] = field(default_factory=list)            # each sequence's last token
    decode_positions: list[int] = field(default_factory=list)      # its position (= context_len - 1)
    decode_slots: list[int] = field(default_factory=list)          # where its K/V go
    decode_tables: list[BlockTable] = field(default_factory=list)  # for block_tables_tensor()
    preempted: list[Request] = field(default_factory=list)

    @property
    def context_lens(self) -> list[int]:
        """Tokens each decode sequence attends to, the new one included."""
        return [p + 1 for p in self.decode_positions]

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.prefill_ids)) + len(self.decode_ids)

    @property
    def requests(self) -> list[Request]:
        """The sequences that get a token this step (the logits' rows): finishing prefills, then decodes."""
        return [r for r, s in zip(self.prefill, self.prefill_sample) if s] + self.decode

    @property
    def scheduled(self) -> list[Request]:
        """Every sequence of the step (partial prefill chunks too)."""
        return self.prefill + self.decode

    @property
    def cached_prefill(self) -> bool:
        """Whether a prefill starts after cached tokens (its attention reads the paged cache)."""
        return any(self.prefill_starts)

    def __bool__(self):
        return bool(self.prefill or self.decode)


def _work(start: int, n: int) -> int:
    """Attention work of prefill rows start..start+n-1: row i reads its context of i + 1 positions."""
    return n * (2 * start + n + 1) // 2


def _within_work(start: int, n: int, work: float, first: bool) -> int:
    """The most rows (at most n) from ``start`` whose work fits ``work``; at least one for the step's first
    prefill (a prompt always progresses)."""
    if n <= 0:
        return 0
    b = 2 * start + 1
    k = int((math.isqrt(b * b + 8 * int(max(work, 0))) - b) // 2)
    return max(min(n, k), 1 if first else 0)


class Scheduler:
    def __init__(self, pool: BlockPool, n_positions: int, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, eos_token_id: int | None = None,
                 vocab_size: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 policy: str = "fcfs", enable_prefix_caching: bool = True, enable_chunked_prefill: bool = False,
                 long_prefill_token_threshold: int | None = None):
        self.pool, self.n_positions = pool, n_positions
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(n_positions, 2048) if max_num_batched_tokens is None \
            else max_num_batched_tokens
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.chunked = bool(enable_chunked_prefill)
        t = long_prefill_token_threshold
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise ValueError(f"long_prefill_token_threshold: expected an int >= 1 or None, got {t!r}")
            if not self.chunked:
                raise ValueError("long_prefill_token_threshold: cuts prompts into chunks; it needs "
                                 "enable_chunked_prefill=True")
        self.long_prefill_token_threshold = t
        self._chunk_cap = t if t is not None else math.inf    # tokens of one prompt per step
        # prefill tokens of a step that also decodes (chunked only): the engine sets its device-side step's
        # prefill rows here, so that a chunk rides beside the decodes in the captured step instead of
        # stalling them with an eager forward; a step with no decodes keeps the whole budget
        self.decode_step_prefill_cap: int | None = None
        # and their attention work beside decodes, in (query token x context position) units: each prefill
        # row reads its whole context, so a chunk late in a long prompt costs its rows times that context;
        # the engine sets this too (None: no limit), so a step beside decodes stays close to a decode step
        self.decode_step_prefill_work: int | None = None
        pool.enable_caching = bool(enable_prefix_caching)
        if isinstance(self.max_num_batched_tokens, bool) or not isinstance(self.max_num_batched_tokens, int) \
                or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: expected an int >= 1, got {self.max_num_batched_tokens!r}")
        # Unchunked, a prefill runs whole: the longest (a full context, when recomputing) must fit in one step.
        if not self.chunked and self.max_num_batched_tokens < n_positions:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is less than the context "
                             f"(n_positions={n_positions}); a long prompt could never be scheduled "
                             "(enable_chunked_prefill=True cuts it into chunks)")
        self.eos_token_id, self.vocab_size, self.clock = eos_token_id, vocab_size, clock
        self.waiting: list[Request] = []     # in policy order: waiting[0] is admitted next
        self.running: list[Request] = []     # in policy order: running[-1] is preempted first
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0}
        self.requests: dict[Any, Request] = {}  # unfinished, by id
        self._order = itertools.count()
        self.num_preemptions = 0
        self._pending = False       # a step was scheduled and its tokens are not back yet

    # ---------------------------------------------------------------------------------------- requests
    def add_request(self, prompt_ids, sampling: SamplingParams | None = None, *, request_id=None,
                    stream=None, truncate: bool = False, arrival_time: float | None = None,
                    priority: int = 0) -> Request:
        """Validate and enqueue; raises ValueError/TypeError (and changes nothing) for a bad request.
        ``priority``: for policy "priority" (the lower, the sooner)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority: expected an int, got {priority!r}")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(prompt_ids, (str, bytes)):
            raise TypeError("prompt_ids must be token ids, not text: tokenize the prompt first")
        if hasattr(prompt_ids, "tolist"):
            prompt_ids = prompt_ids.tolist()
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        # plain ints (the common case) are checked in C (a 2k-token prompt's Python loop cost ~0.5 ms, a
        # stall of every running decode's next token when it arrives between two steps)
        if set(map(type, prompt_ids)) != {int}:
            for i, t in enumerate(prompt_ids):
                if isinstance(t, bool) or not hasattr(t, "__index__"):
                    raise TypeError(f"prompt_ids must be ints, got {t!r} ({type(t).__name__})")
                prompt_ids[i] = operator.index(t)
        if min(prompt_ids) < 0 or (self.vocab_size is not None and max(prompt_ids) >= self.vocab_size):
            t = next(t for t in prompt_ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size))
            raise ValueError(f"token id {t} in prompt_ids is outside the vocabulary "
                             f"(0..{self.vocab_size - 1 if self.vocab_size else 'vocab_size-1'})")
        max_new, ctx = sampling.max_new_tokens, self.n_positions
        truncated = 0
        if len(prompt_ids) + max_new > ctx:
            if not truncate or max_new >= ctx:
                raise ContextLimitError(len(prompt_ids), max_new, ctx, truncate)
            keep = ctx - max_new
            truncated, prompt_ids = len(prompt_ids) - keep, prompt_ids[-keep:]
        # The last sampled token is never fed back, so a sequence holds at most prompt + max_new - 1 tokens.
        need = math.ceil((len(prompt_ids) + max_new - 1) / self.pool.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"request needs {need} KV blocks ({len(prompt_ids)} prompt + {max_new} new tokens), "
                             f"more than the whole pool ({self.pool.num_blocks} blocks of {self.pool.block_size})")
        if stream is not None and not (callable(stream) or hasattr(stream, "put")):
            raise TypeError(f"stream must be a callable(request, token) or a queue, got {type(stream).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        order = next(self._order)
        if request_id is None:      # the arrival number, unless a caller took it as an id
            request_id = next(i for i in itertools.count(order) if i not in self.requests)
        req = Request(request_id, prompt_ids, max_new, sampling,
                      self.clock() if arrival_time is None else arrival_time, stream=stream,
                      truncated=truncated, order=order, priority=priority)
        self.requests[request_id] = req
        bisect.insort(self.waiting, req, key=self._key)
        return req

    def _key(self, req: Request) -> tuple:
        """Policy order: the smaller, the sooner admitted and the later preempted."""
        if self.policy == "priority":
            return (req.priority, req.order)
        if self.policy == "spf":
            return (len(req.prompt_ids), req.order)
        return (req.order,)

    def abort(self, request_id) -> Request:
        if request_id not in self.requests:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        req = self.requests[request_id]
        self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str) -> None:
        """Retire ``req`` now: its blocks go back to the pool and its stream gets the end marker."""
        if req.state == FINISHED:
            return
        if req.state == RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if req.table is not None:
            req.table.free(uncache=reason == "error")   # a failed step: its cache contents are unknown
            req.table = None
        req.state, req.finish_reason, req.finish_time = FINISHED, reason, self.clock()
        del self.requests[req.id]
        self._emit(req, None)

    def abandon_step(self) -> None:
        """The step scheduled last will not hand its tokens back (it failed): scheduling may go on."""
        self._pending = False

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------------------------------- steps
    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """The next step's work. ``admit=False`` runs the running sequences and admits no one (the
        engine batches prefills up when each prefill forward costs more than the decodes beside it)."""
        if self._pending:
            raise RuntimeError("schedule() called again before update() returned the last step's tokens")
        out = SchedulerOutput()
        pool = self.pool
        budget = self.max_num_batched_tokens
        # Decodes first: their tokens are counted before any chunk takes what is left of the budget.
        # (This loop runs over every running sequence each step: the common case, a decode whose block
        # has room, touches no property and allocates nothing.)
        bs = pool.block_size
        caching = pool.enable_caching
        running = list(self.running)
        lefts = [len(r.prompt_ids) + len(r.output_ids) - r.num_computed for r in running]
        reserved = lefts.count(1)
        # prefill tokens this step may still take (the cap holds only beside decodes)
        capped = self.chunked and reserved and self.decode_step_prefill_cap
        pcap = self.decode_step_prefill_cap if capped else math.inf
        work = self.decode_step_prefill_work if capped and self.decode_step_prefill_work else math.inf
        for req, left in zip(running, lefts):
            if req.state != RUNNING:        # preempted for an earlier one, earlier in this loop
                continue
            if left == 1:
                reserved -= 1
                n = 1
            else:                           # a prompt being prefilled in chunks
                n = min(left, budget - reserved, self._chunk_cap, pcap)
                if work != math.inf:
                    n = _within_work(req.num_computed, n, work, first=pcap == self.decode_step_prefill_cap)
                if n <= 0:
                    continue
                pcap -= n
                work -= _work(req.num_computed, n)
            end = req.num_computed + n
            table = req.table
            if end > len(table.blocks) * bs:
                while table.blocks_needed(end) > pool.num_free:
                    victim = self.running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        break
                if req.state != RUNNING:
                    continue
                table.ensure_capacity(end)
            budget -= n
            if left == 1:
                pos = end - 1
                out.decode.append(req)
                n_prompt = len(req.prompt_ids)    # (not all_ids: that copies the whole sequence)
                out.decode_ids.append(req.prompt_ids[pos] if pos < n_prompt else req.output_ids[pos - n_prompt])
                out.decode_positions.append(pos)
                out.decode_slots.append(table.blocks[pos // bs] * bs + pos % bs)
                out.decode_tables.append(table)
            else:
                self._add_prefill(out, req, req.num_computed, end)
            # blocks whose K/V this step computes are found by prefills later in it, and in later steps
            # (a decode fills a block once per block_size steps: all_ids, a copy, only then)
            if caching and end // bs > len(table.hashes):
                table.cache_full(req.all_ids, end)

        # Admit in policy order (no skipping ahead: the head would starve). Not after a preemption: the
        # blocks just freed belong to the request at the front, once there is room.
        while admit and self.waiting and not out.preempted and len(self.running) < self.max_num_seqs \
                and budget > 0 and pcap > 0:
            req = self.waiting[0]
            ids = req.all_ids
            n = len(ids)
            bs = pool.block_size
            hashes, hit = [], []
            if pool.enable_caching:         # the last token is always computed: its logits are needed
                hashes = pool.hash_blocks(ids, 0, (n - 1) // bs)
                hit = pool.match(hashes)
            start = len(hit) * bs
            take = min(budget, self._chunk_cap, pcap)
            if work != math.inf:
                take = _within_work(start, take, work, first=pcap == self.decode_step_prefill_cap)
                if take <= 0:
                    break
            end = n if n - start <= take else start + take if self.chunked else None
            if end is None:
                break
            need = math.ceil(end / bs) - len(hit) + pool.num_evictable(hit)
            if need > pool.num_free:
                break
            self.waiting.pop(0)
            req.table = BlockTable(pool)
            req.table.adopt(hit, hashes[:len(hit)])
            req.table.ensure_capacity(end)
            req.num_computed = req.num_cached_tokens = start
            req.state = RUNNING
            bisect.insort(self.running, req, key=self._key)
            self._add_prefill(out, req, start, end)
            req.table.cache_full(ids, end)
            budget -= end - start
            pcap -= end - start
            if work != math.inf:
                work -= _work(start, end - start)
            self.stats["cached_tokens"] += start
        self.stats["prefill_tokens"] += sum(map(len, out.prefill_ids))
        self._pending = bool(out)
        return out

    @staticmethod
    def _add_prefill(out: SchedulerOutput, req: Request, start: int, end: int) -> None:
        out.prefill.append(req)
        out.prefill_ids.append(req.all_ids[start:end])
        out.prefill_slots.append(req.table.slots(start, end))
        out.prefill_starts.append(start)
        out.prefill_tables.append(req.table)
        out.prefill_sample.append(end == req.num_tokens)

    def update(self, out: SchedulerOutput, next_tokens) -> list[Request]:
        """Append each sequence's sampled token (prefills first, then decodes); returns those that finished."""
        reqs = out.requests
        if hasattr(next_tokens, "tolist"):
            next_tokens = next_tokens.tolist()
        if len(next_tokens) != len(reqs):
            raise ValueError(f"got {len(next_tokens)} tokens for {len(reqs)} scheduled sequences")
        self._pending = False
        for req, ids, start, last in zip(out.prefill, out.prefill_ids, out.prefill_starts, out.prefill_sample):
            if not last and req.state == RUNNING:     # a chunk: its K/V are in, no token yet
                req.num_computed = start + len(ids)
        return self._append(reqs, next_tokens)

    def _append(self, reqs, next_tokens) -> list[Request]:
        """:meth:`update`'s per-token part: one token for each of ``reqs``."""
        now = self.clock()
        done = []
        for req, tok in zip(reqs, next_tokens):
            if req.state != RUNNING:        # aborted (or finished by the engine) since schedule()
                continue
            tok = int(tok)
            req.num_computed = req.num_tokens
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            self._emit(req, tok)
            if req.state == FINISHED:       # its stream failed
                done.append(req)
                continue
            if (tok == self.eos_token_id and not req.sampling.ignore_eos) or tok in req.sampling.stop_token_ids:
                self.finish(req, "stop")
            elif len(req.output_ids) >= req.max_new_tokens:
                self.finish(req, "length")
            if req.state == FINISHED:
                done.append(req)
        return done

    def reserve(self, out: SchedulerOutput, steps: int) -> bool:
        """Blocks for ``steps`` decode steps of every sequence in ``out.decode`` (the engine runs several
        steps between two host round trips): a sequence with r tokens left gets room for min(steps, r)
        new positions. All or nothing: False (and nothing allocated) when the pool is short."""
        pool = self.pool
        need = []
        for req in out.decode:
            n = req.num_tokens - 1 + min(steps, req.max_new_tokens - len(req.output_ids))
            need.append((req, n, req.table.blocks_needed(n)))
        if sum(k for _, _, k in need) > pool.num_free:
            return False
        for req, n, k in need:
            if k:
                req.table.ensure_capacity(n)
        return True

    def update_steps(self, out: SchedulerOutput, steps) -> list[Request]:
        """:meth:`update` once per step of a multi-step decode: ``steps`` holds, for each step, one token
        per sequence of ``out.decode``. A sequence that finishes ignores its later tokens."""
        if out.prefill:
            raise ValueError("update_steps: a step with prefills runs one step at a time")
        # update()'s checks once, then only its per-token part per step (this runs per decoded token)
        reqs = out.decode
        done = []
        for tokens in steps:
            self._pending = True
            if hasattr(tokens, "tolist"):
                tokens = tokens.tolist()
            if len(tokens) != len(reqs):
                raise ValueError(f"got {len(tokens)} tokens for {len(reqs)} scheduled sequences")
            self._pending = False
            done += self._append(reqs, tokens)
        return done

    def update_tokens(self, out: SchedulerOutput, tokens) -> list[Request]:
        """:meth:`update` with several tokens for each sequence of ``out.decode`` (speculative decoding:
        the accepted draft tokens and the one sampled after them), ``tokens[i]`` for sequence i, in order.
        A sequence that finishes ignores its later tokens."""
        if out.prefill:
            raise ValueError("update_tokens: a step with prefills runs one step at a time")
        if len(tokens) != len(out.decode):
            raise ValueError(f"got tokens for {len(tokens)} sequences, {len(out.decode)} were scheduled")
        done = []
        for j in range(max(map(len, tokens), default=0)):
            sub = SchedulerOutput(decode=[r for r, t in zip(out.decode, tokens) if len(t) > j])
            self._pending = True
            done += self.update(sub, [t[j] for t in tokens if len(t) > j])
        self._pending = False
        return done

    # ---------------------------------------------------------------------------------------- internals
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.table.free()        # its full blocks stay cached: the recompute will likely find them
        req.table = None
        req.num_computed = 0
        req.state = WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=self._key)

    def _emit(self, req: Request, tok: int | None) -> None:
        """Hand a token (None: the end) to the request's stream; a failing stream ends only its request."""
        if req.stream is None:
            return
        try:
            if callable(req.stream):
                req.stream(req, tok)
            else:
                req.stream.put(tok)
        except Exception as e:  # noqa: BLE001 (a consumer's bug must not stop the other requests)
            if tok is not None and req.state != FINISHED:
                req.error = e
                self.finish(req, "error")
