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
from tritune.model.engine.sampling import SamplingParams  # noqa: F401  (re-exported: its home before)

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
    def tokens_left(self) -> int:
        """New tokens the request may still get (``max_new_tokens`` less those it has)."""
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state == FINISHED


def eos_ids(eos_token_id=None, eos_token_ids=()) -> tuple:
    """Every EOS id of a model, ``eos_token_id`` first (None and repeats dropped): the ids that end a request."""
    out = []
    for e in (eos_token_id, *(eos_token_ids or ())):
        if e is not None and e not in out:
            if isinstance(e, bool) or not isinstance(e, int):
                raise TypeError(f"eos_token_ids: expected ints, got {type(e).__name__} {e!r}")
            out.append(e)
    return tuple(out)


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


def _positive(name: str, v, allow_none: bool = True, lo: int = 1) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}{' or None' if allow_none else ''}, got {v!r}")


@dataclass
class _Room:
    """What a step has left while :meth:`Scheduler.schedule` fills it: tokens of the budget, prefill tokens
    beside decodes (``pcap``) and their attention work (``work``), and the decodes not yet counted."""
    budget: int
    pcap: float
    work: float
    reserved: int
    cap: int | None         # the prefill cap in force (the first prefill beside decodes always progresses)

    def take(self, start: int, n: int) -> None:
        self.budget -= n
        self.pcap -= n
        if self.work != math.inf:
            self.work -= _work(start, n)

    def fit(self, start: int, n: int) -> int:
        """At most n prefill rows from ``start`` within the attention work left."""
        return n if self.work == math.inf else _within_work(start, n, self.work, first=self.pcap == self.cap)


class Scheduler:
    """Which sequences run each step (the module docstring), when waiting requests are admitted, and how
    many decode steps the engine may run before it asks again.

    Prefill batching (``prefill_batching``): with a fast decode path a step that admits requests pays an
    eager forward for their prefills (about as long as many decode steps), so while sequences decode,
    waiting requests are admitted only once ``prefill_min_seats`` seats are free (default max_num_seqs // 8)
    or after ``prefill_max_wait`` steps of waiting. ``decode_step_prefill_cap`` / ``_work`` (chunked prefill):
    prefill tokens, and their attention work in (query token x context position) units, that a step which
    also decodes may take, so that a chunk rides beside the decodes in the engine's device-side step
    instead of stalling them (a step with no decodes keeps the whole budget).
    """

    def __init__(self, pool: BlockPool, n_positions: int, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, eos_token_id: int | None = None,
                 eos_token_ids=(), vocab_size: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 policy: str = "fcfs", enable_prefix_caching: bool = True, enable_chunked_prefill: bool = False,
                 long_prefill_token_threshold: int | None = None, prefill_batching: bool = False,
                 prefill_min_seats: int | None = None, prefill_max_wait: int = 8,
                 decode_step_prefill_cap: int | None = None, decode_step_prefill_work: int | None = None):
        self.pool, self.n_positions = pool, n_positions
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(n_positions, 2048) if max_num_batched_tokens is None \
            else max_num_batched_tokens
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.chunked = bool(enable_chunked_prefill)
        t = long_prefill_token_threshold
        _positive("long_prefill_token_threshold", t)
        if t is not None and not self.chunked:
            raise ValueError("long_prefill_token_threshold: cuts prompts into chunks; it needs "
                             "enable_chunked_prefill=True")
        self.long_prefill_token_threshold = t
        self._chunk_cap = t if t is not None else math.inf    # tokens of one prompt per step
        _positive("decode_step_prefill_cap", decode_step_prefill_cap)
        _positive("decode_step_prefill_work", decode_step_prefill_work)
        self.decode_step_prefill_cap = decode_step_prefill_cap if self.chunked else None
        self.decode_step_prefill_work = decode_step_prefill_work if self.chunked and decode_step_prefill_cap else None
        _positive("prefill_min_seats", prefill_min_seats)
        _positive("prefill_max_wait", prefill_max_wait, allow_none=False, lo=0)
        self.prefill_batching = bool(prefill_batching)
        self.prefill_min_seats = max(1, max_num_seqs // 8) if prefill_min_seats is None else prefill_min_seats
        self.prefill_max_wait = prefill_max_wait
        self._waited = 0            # steps the queue has waited for seats (prefill batching)
        pool.enable_caching = bool(enable_prefix_caching)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=False)
        # Unchunked, a prefill runs whole: the longest (a full context, when recomputing) must fit in one step.
        if not self.chunked and self.max_num_batched_tokens < n_positions:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is less than the context "
                             f"(n_positions={n_positions}); a long prompt could never be scheduled "
                             "(enable_chunked_prefill=True cuts it into chunks)")
        self.eos_token_id, self.vocab_size, self.clock = eos_token_id, vocab_size, clock
        # every id that ends a request (Llama-3 lists several: end of text, end of turn, ...)
        self.eos_ids = frozenset(eos_ids(eos_token_id, eos_token_ids))
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
    def schedule(self, admit: bool | None = None) -> SchedulerOutput:
        """The next step's work: the running sequences (decodes first, then chunks), then waiting requests
        in policy order. ``admit``: None admits by the scheduler's rule (:meth:`admits`: prefill batching);
        False runs the running sequences and admits no one; True admits whatever fits."""
        if self._pending:
            raise RuntimeError("schedule() called again before update() returned the last step's tokens")
        out = SchedulerOutput()
        running = list(self.running)
        lefts = [len(r.prompt_ids) + len(r.output_ids) - r.num_computed for r in running]
        reserved = lefts.count(1)
        # prefill tokens this step may still take (the cap holds only beside decodes)
        capped = self.chunked and reserved and self.decode_step_prefill_cap
        cap = self.decode_step_prefill_cap if capped else None
        room = _Room(self.max_num_batched_tokens, cap if capped else math.inf,
                     self.decode_step_prefill_work if capped and self.decode_step_prefill_work else math.inf,
                     reserved, cap)
        # Decodes first: their tokens are counted before any chunk takes what is left of the budget.
        self._schedule_running(out, running, lefts, room)
        # Not after a preemption: the blocks just freed belong to the request at the front, once there is room.
        if (self.admits() if admit is None else admit) and not out.preempted:
            self._admit(out, room)
        self.stats["prefill_tokens"] += sum(map(len, out.prefill_ids))
        self._pending = bool(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, running: list[Request], lefts: list[int], room: _Room) -> None:
        """Each running sequence's decode token or next chunk, preempting the last in policy order when
        blocks run out. (This runs over every running sequence each step: the common case, a decode whose
        block has room, touches no property and allocates nothing.)"""
        pool = self.pool
        bs = pool.block_size
        caching = pool.enable_caching
        for req, left in zip(running, lefts):
            if req.state != RUNNING:        # preempted for an earlier one, earlier in this loop
                continue
            if left == 1:
                room.reserved -= 1
                n = 1
            else:                           # a prompt being prefilled in chunks
                n = room.fit(req.num_computed, min(left, room.budget - room.reserved, self._chunk_cap, room.pcap))
                if n <= 0:
                    continue
                room.pcap -= n
                if room.work != math.inf:
                    room.work -= _work(req.num_computed, n)
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
            room.budget -= n
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

    def _admit(self, out: SchedulerOutput, room: _Room) -> None:
        """Admit waiting requests in policy order (no skipping ahead: the head would starve) while seats,
        blocks and the step's room last; each starts after the cached blocks matching its tokens."""
        pool = self.pool
        bs = pool.block_size
        while self.waiting and len(self.running) < self.max_num_seqs and room.budget > 0 and room.pcap > 0:
            req = self.waiting[0]
            ids = req.all_ids
            n = len(ids)
            hashes, hit = [], []
            if pool.enable_caching:         # the last token is always computed: its logits are needed
                hashes = pool.hash_blocks(ids, 0, (n - 1) // bs)
                hit = pool.match(hashes)
            start = len(hit) * bs
            take = room.fit(start, min(room.budget, self._chunk_cap, room.pcap))
            if take <= 0:
                break
            end = n if n - start <= take else start + take if self.chunked else None
            if end is None or math.ceil(end / bs) - len(hit) + pool.num_evictable(hit) > pool.num_free:
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
            room.take(start, end - start)
            self.stats["cached_tokens"] += start

    # ---------------------------------------------------------------------------------------- admission
    def admits(self) -> bool:
        """Whether this step admits waiting requests (prefill batching; see the class docstring). Counts the
        steps the queue waits."""
        if not self.prefill_batching or not self.running or not self.waiting:
            self._waited = 0
            return True
        seats = self.max_num_seqs - len(self.running)   # (max_num_seqs as it is now: a benchmark may lower it)
        need = min(self.prefill_min_seats, max(1, self.max_num_seqs // 8), len(self.waiting))
        if seats >= need or self._waited >= self.prefill_max_wait:
            self._waited = 0
            return True
        self._waited += 1
        return False

    def seat_wait_left(self) -> float:
        """Steps left of the queue's wait for seats under prefill batching (at least 1), while requests wait
        and seats are free; else inf."""
        if self.waiting and self.prefill_batching and len(self.running) < self.max_num_seqs:
            return max(1, self.prefill_max_wait - self._waited)
        return math.inf

    def steps_before_admission(self, rows: list[Request]) -> float:
        """Decode steps of ``rows`` the engine may run back to back before admission must be decided again:
        :meth:`seat_wait_left` while requests wait with seats free; while they wait with every seat taken,
        until one of ``rows`` can finish; else no limit (inf)."""
        if not self.waiting:
            return math.inf
        if self.prefill_batching and len(self.running) < self.max_num_seqs:
            return self.seat_wait_left()
        return min((r.tokens_left for r in rows), default=math.inf)

    def run_length(self, out: SchedulerOutput, max_steps: int) -> int:
        """How many decode steps of ``out`` (decodes only) the engine runs before the host looks at their
        tokens again: at most ``max_steps``, no more than the longest row has left (rows done earlier
        turn to padding), no more than :meth:`steps_before_admission`, and 1 when the pool cannot hold that
        many tokens of every row (the blocks for the steps are reserved here)."""
        K = min(max_steps, max(r.tokens_left for r in out.decode), self.steps_before_admission(out.decode))
        K = max(1, int(K))
        if K > 1 and not self.reserve(out, K):
            K = 1                       # not enough free blocks to hold K tokens of every row
        return K

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
            if (tok in self.eos_ids and not req.sampling.ignore_eos) or tok in req.sampling.stop_token_ids:
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
            n = req.num_tokens - 1 + min(steps, req.tokens_left)
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
        if len(steps) > 1 and self.waiting and self.prefill_batching:
            self._waited += len(steps) - 1      # each step after the first was one the queue waited
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
