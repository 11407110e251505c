"""The serving engine's request loop: requests in, one step at a time, tokens out.

Each :meth:`Engine.step`:

1. ``schedule()`` picks the step's work (:mod:`~tritune.model.engine.scheduler`): one decode token for every
   running sequence, plus whole prefills of newly admitted (or preempted, recomputed) requests while
   blocks and the token budget last.
2. The model runner (:mod:`~tritune.model.engine.runner`) runs it: one forward, or, when the step only decodes,
   the device-side decode step (CUDA graphs, :mod:`~tritune.model.engine.graphs`) up to ``decode_steps`` times
   back to back with one host sync (greedy tokens picked on the device, sampled ones drawn there
   between replays).
3. Sampling (:mod:`~tritune.model.engine.sampling`), then ``update()`` appends the tokens, streams them, and
   retires finished requests, freeing their blocks; stop strings are checked here, on the text.

Weight-only quantization (``quant="int8" | "int4"``) is a load-time swap (:mod:`~tritune.model.quant.ops`):
the engine runs the quantized copy of the model it is given, and nothing downstream branches on it.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass

import torch

from tritune.model.quant import ops as Q
from tritune.model.engine.config import (GRAPH_BUCKETS, GRAPH_PREFILL_TOKENS, GRAPH_PREFILL_WORK,  # noqa: F401
                                         EngineConfig)
from tritune.model.engine.graphs import DecodeGraphs  # noqa: F401  (re-exported)
from tritune.model.engine import contract
from tritune.model.engine.kv_cache import BlockPool, blocks_for_budget, bytes_per_block
from tritune.model.engine.runner import ModelRunner, forward_step  # noqa: F401  (forward_step re-exported)
from tritune.model.engine.sampling import Sampler, sample  # noqa: F401  (sample re-exported)
from tritune.model.engine.scheduler import (FINISHED, ContextLimitError, Request, SamplingParams,  # noqa: F401
                                            Scheduler, SchedulerOutput)
from tritune.model.load import set_cpu_threads

QUANT_MODES = Q.QUANT_MODES
quantize_weights = Q.quantize_weights
CPU_KV_BYTES = 256 << 20          # default KV budget without a GPU
_THREADS_AT_IMPORT = torch.get_num_threads()    # (a program that sets its own count keeps it: set_cpu_threads)


# ---------------------------------------------------------------------------------------------------
# Results and streams
# ---------------------------------------------------------------------------------------------------
@dataclass
class Completion:
    request_id: object
    prompt_ids: list
    token_ids: list
    finish_reason: str | None
    text: str | None = None
    error: str | None = None          # why the request was rejected (generate(..., errors="return"))
    truncated: int = 0
    num_preemptions: int = 0
    ttft_s: float = float("nan")      # arrival -> first token
    tpot_s: float = float("nan")      # mean time per output token after the first
    latency_s: float = float("nan")   # arrival -> last token


def completion_of(req: Request, tokenizer=None) -> Completion:
    """The request's result; its text when a tokenizer is given (a tokenizer that fails on these tokens
    leaves the text None and says why in ``error``: the other completions are not affected)."""
    n = len(req.output_ids)
    ttft = req.first_token_time - req.arrival_time if req.first_token_time is not None else float("nan")
    lat = req.finish_time - req.arrival_time if req.finish_time is not None else float("nan")
    tpot = ((req.finish_time - req.first_token_time) / (n - 1)
            if n > 1 and req.finish_time is not None and req.first_token_time is not None else float("nan"))
    error = repr(req.error) if req.error is not None else None
    text = None
    if tokenizer is not None:
        try:
            text = tokenizer.decode(req.output_ids)
        except Exception as e:  # noqa: BLE001 (one request's detokenizing must not fail the batch)
            error = error or f"detokenizing the output failed: {e!r}"
    return Completion(req.id, list(req.prompt_ids), list(req.output_ids), req.finish_reason, text,
                      error, req.truncated, req.num_preemptions, ttft, tpot, lat)


class TokenStream:
    """Iterate the tokens of one request as they are sampled; iterating drives ``engine.step()``
    (which advances every other request too). ``.request`` is the scheduler's Request."""

    def __init__(self, engine):
        self.engine = engine
        self.buffer: deque = deque()
        self.done = False
        self.request: Request | None = None

    def __call__(self, req, tok):
        if tok is None:
            self.done = True
        else:
            self.buffer.append(tok)

    def __iter__(self):
        return self

    def __next__(self) -> int:
        while not self.buffer:
            if self.done:
                raise StopIteration
            self.engine.step()
        return self.buffer.popleft()


# ---------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------
class Engine:
    """Continuous-batching serving on a paged KV cache.

    ``model``: any model that meets the engine's contract (:class:`~tritune.model.engine.contract.EngineModel`;
    :class:`tritune.model.gpt2.model.GPT2` is one). ``config``: an :class:`~tritune.model.engine.config.EngineConfig`;
    the keywords below build one (with ``config`` given, they override its fields). The KV pool is sized by exactly one of ``num_blocks``,
    ``kv_memory_bytes`` or ``kv_memory_fraction`` (of free GPU memory); default 0.5 on a GPU, 256 MiB on
    the CPU. ``max_batch_tokens``: tokens per step (prefill tokens + one per decode; >= n_positions
    unless ``enable_chunked_prefill``, which cuts long prompts into chunks run beside the decodes).
    ``enable_prefix_caching`` (default on): full KV blocks are shared by requests with the same prefix,
    whose prefill computes only the rest. In the default mode a hit may differ from the uncached request
    in the last bits of its logits (and, where two tokens' logits are that close, in a greedy token): the
    cached K/V were computed inside another request's prefill and the suffix attends through the cache
    (gathered context, another kernel launch shape), and the kernels' reduction order follows the rows a
    launch holds. With ``batch_invariant`` (``--deterministic``) every row's reductions are its own, so a
    hit gives the uncached request's bits. ``policy``: "fcfs", "priority" (``add_request(...,
    priority=)``, lower first) or "spf" (shortest prompt first). ``speculative``: a proposer
    (:mod:`~tritune.model.engine.spec_decode`) whose k draft tokens a step verifies in one forward; with the
    device-side step, a step of more decoding rows than its largest batch (16) runs as a plain decode step,
    counted in ``stats["spec_over_batch_steps"]`` and logged the first time. ``prefill_batching``,
    ``prefill_min_seats``, ``prefill_max_wait``: when waiting requests are admitted
    (:class:`~tritune.model.engine.scheduler.Scheduler`). ``cuda_graphs``: capture the decode step per batch bucket (CUDA and the
    triton backend only; otherwise ignored and said in ``notes``; ``"eager"``: the same device-side step
    without capture). ``decode_steps``: on that path, a step that only decodes runs up to this many
    steps back to back (the tokens fed back on the device), then reads all their tokens with one sync
    (1: one step per sync; stop strings, checked on the text, take one step per sync). ``compile``: torch.compile the decode forward instead (dynamic
    shapes). ``quant``: None, "int8" or "int4" weight-only for every linear (round to nearest; a model
    quantized beforehand, e.g. by ``tritune.model.quant.ops.with_quantized_weights``, runs as it is), or
    "fp8": W8A8 e4m3 (:mod:`~tritune.model.quant.fp8`; per-channel weight scales, 128x128 blocks with
    ``fp8_block``). ``kv_cache_dtype``: None (the model's dtype) or "fp8": the paged cache in e4m3 with
    per-token scales (:mod:`~tritune.model.engine.kv_fp8`; not with speculative, batch_invariant, compile).
    ``batch_invariant``: every kernel's reduction order pinned per request (:mod:`~tritune.model.engine.invariant`):
    a request's tokens are bitwise those it gets alone, and a token's logits the same prefilled or decoded.
    ``fused_decode``: True, False or "auto" (default): device-side decode steps of up to 8 rows as one
    persistent launch (:mod:`~tritune.model.engine.fused_decode`); "auto" takes it where the tuned store says it
    measured faster on this GPU. ``run_ahead``: a step of decodes only on the device-side step returns with its steps queued on the
    device, not waited for; the next :meth:`step` reads their tokens first (one sync), then schedules. The
    caller's work on the tokens a step handed over (streaming them, detokenizing, printing) then overlaps
    the GPU's next steps instead of leaving it idle (``tritune generate``: about 30 us of host work per
    token at batch 1, against about 130 us of GPU). A token then reaches its stream one ``step()`` later.
    ``graph_prefill_tokens`` (default 64): a step with at most this many prefill tokens runs them inside
    the device-side decode step, beside its decodes (:mod:`~tritune.model.engine.runner`); 0: prefills eager.
    With chunked prefill, a step that decodes takes at most this many prefill tokens, so that long prompts
    arrive in chunks that ride in the captured step (a step with no decodes keeps the whole budget).
    ``graph_prefill_work`` (default 16384; None: no limit): beside decodes, the prefill rows of a step read
    at most this many context positions in all (a row reads its whole context): a chunk late in a long
    prompt gets fewer rows, so that step costs about what a decode step costs (H100, GPT-2 small, 32
    decodes: a 16-row chunk at context 2048 doubled the step's GPU time).
    ``long_prefill_token_threshold`` (chunked prefill only; default None: off): at most this many tokens of
    one prompt per step, e.g. ``graph_prefill_tokens`` so that every chunk takes that path.
    ``stats["request_errors"]``: requests ended alone by a failure of their own (:meth:`step`).
    ``tensor_parallel`` (default 1): split the model over this many ranks (:mod:`tritune.model.parallel`:
    processes started here, gloo on the CPU, NCCL on GPUs; this process is rank 0 and schedules); a model
    that is already one rank's shard runs as it is. Every rank captures and replays the same decode graphs
    (rank 0 broadcasts each load and replay); :meth:`close` stops the ranks.
    ``path_counts``: how many steps took each path ("graph": decode-only replays, "graph-mixed",
    "graph-prefill", "graph" beside an eager prefill is "graph+eager", "eager", "mixed", "compile", "spec").
    """

    def __init__(self, model, config: EngineConfig | None = None, *, tokenizer=None, **kwargs):
        cfg = self.engine_config = EngineConfig.build(config, **kwargs)
        contract.check(model)
        from tritune.model.parallel import serving as tp
        # one rank's shard of a tensor-parallel model (tritune.model.parallel), split here for tensor_parallel > 1
        model = tp.engine_model(model, cfg.tensor_parallel, quant=cfg.quant, compile=cfg.compile,
                                batch_invariant=cfg.batch_invariant, speculative=cfg.speculative is not None,
                                kv_cache_dtype=cfg.kv_cache_dtype)
        self.decode_steps = cfg.decode_steps
        self.run_ahead = cfg.run_ahead
        self._ahead = None      # (out, launched) of decode steps queued by the last step(), tokens not read yet
        self.config = model.config
        self.device = torch.device(model.device)
        self.dtype = model.dtype
        self.tokenizer = tokenizer
        self.notes: list[str] = []
        self.block_size = cfg.block_size
        self.max_blocks = math.ceil(model.max_context / cfg.block_size)
        self.max_num_seqs = cfg.max_num_seqs
        if self.device.type == "cpu":
            set_cpu_threads(unless_changed_from=_THREADS_AT_IMPORT)
        model = self._prepare(model, cfg)
        self.pool = self._make_pool(model, cfg)
        model = self._on_fp8_pool(model)
        sharded = hasattr(model, "tp")      # a tensor-parallel rank: its graphs captured with the group's
        self.runner = ModelRunner(model, self.pool, max_num_seqs=cfg.max_num_seqs, cuda_graphs=cfg.cuda_graphs,
                                  compile=cfg.compile, graph_buckets=cfg.graph_buckets,
                                  hist=max(16, cfg.decode_steps), fused_decode=False if sharded else cfg.fused_decode,
                                  graph_prefill_tokens=cfg.graph_prefill_tokens, invariant=self.batch_invariant,
                                  defer_capture=sharded)
        # chunks beside decodes stay within the captured step's prefill rows (no eager stall)
        cap = self.runner.graph_prefill_tokens if cfg.enable_chunked_prefill else 0
        self.scheduler = Scheduler(
            self.pool, model.max_context, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_batch_tokens,
            eos_token_id=model.eos_token_id, eos_token_ids=contract.eos_ids(model), vocab_size=model.vocab_size,
            policy=cfg.policy,
            enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=cfg.enable_chunked_prefill,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            # with a fast decode path a prefill costs a forward of its own: batch them (Scheduler's docstring)
            prefill_batching=self.runner.fast if cfg.prefill_batching is None else cfg.prefill_batching,
            prefill_min_seats=cfg.prefill_min_seats, prefill_max_wait=cfg.prefill_max_wait,
            decode_step_prefill_cap=cap or None, decode_step_prefill_work=cfg.graph_prefill_work if cap else None)
        self.notes += self.runner.notes
        self.tp_lead = tp.engine_lead(self.runner, model)     # rank 0 broadcasts each step to the other ranks
        if self.tp_lead is not None:
            g = model.tp.group
            why = (g.fast.get("why") or {}).get(model.dtype, "not set up")
            self.notes.append(f"tensor parallel over {g.world_size} ranks ({g.backend}; all-reduce "
                              f"{'one-shot over symmetric memory' if why is None else g.backend + ': ' + why}); "
                              + ("every rank replays the same decode graphs" if self.runner.graphs is not None
                                 else "decode steps eager"))
        self.sampler = Sampler(self.device)
        self._init_stats()
        self.spec = None
        if cfg.speculative is not None:
            from tritune.model.engine.spec_decode import SpeculativeDecoder

            self.spec = SpeculativeDecoder(cfg.speculative, self)

    def _prepare(self, model, cfg: EngineConfig):
        """The model as the engine runs it: quantized (``quant``), on pinned reduction orders
        (``batch_invariant``, or a model already on invariant ops: ``tritune generate --deterministic``'s)."""
        if cfg.quant:
            model = Q.quantize_model(model, cfg.quant, cfg.group_size, cfg.fp8_block)
        self.quant = cfg.quant or (model.ops.quant if Q.is_quantized(model) else None)
        if self.quant:
            self.notes.append(f"{self.quant} linears: {model.ops.steps['linear']}")
        from tritune.model.engine import invariant

        self.batch_invariant = cfg.batch_invariant or invariant.is_invariant(model)
        if self.batch_invariant and self.quant in ("fp8", "fp8-block"):
            raise ValueError("quant: FP8 linears do not run with batch_invariant (its pinned kernels take dense "
                             "or int8/int4 weights)")
        if self.batch_invariant:    # pinned reduction orders (tritune.model.engine.invariant); CUDA graphs kept
            if cfg.compile:
                raise ValueError("batch_invariant and compile: the compiled decode's reductions follow the batch")
            model = invariant.invariant_model(model)
            self.notes.append("batch-invariant: each request's logits independent of what shares its steps")
        return model

    def _make_pool(self, model, cfg: EngineConfig) -> BlockPool:
        """The KV block pool, sized by ``num_blocks``, ``kv_memory_bytes`` or ``kv_memory_fraction`` (default:
        half the free GPU memory, at most twice the blocks ``max_num_seqs`` sequences of the full context hold;
        CPU_KV_BYTES on the CPU)."""
        memory, num_blocks = None, cfg.num_blocks
        kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else self.dtype
        if num_blocks is None:
            if cfg.kv_memory_bytes is not None:
                memory = int(cfg.kv_memory_bytes)
            elif cfg.kv_memory_fraction is not None:
                memory = float(cfg.kv_memory_fraction)
            elif self.device.type == "cuda":   # no more than the engine can use (prefix-cache room included)
                per_block = bytes_per_block(model.n_layers, model.n_kv_heads, model.head_dim, cfg.block_size,
                                            kv_dtype)
                num_blocks = min(blocks_for_budget(0.5, per_block, self.device),
                                 2 * cfg.max_num_seqs * math.ceil(model.max_context / cfg.block_size))
            else:
                memory = CPU_KV_BYTES
        # the prefix cache's keys include what else K/V depend on: the model, its dtype and quantization
        salt = (f"{model.config}|{getattr(model, 'directory', None)}|{self.dtype}|{self.quant}|{cfg.group_size}"
                f"|{cfg.fp8_block}|{cfg.kv_cache_dtype}|{id(model.w)}")
        return BlockPool(model.n_layers, model.n_kv_heads, model.head_dim, cfg.block_size, kv_dtype, self.device,
                         num_blocks=num_blocks, memory=memory, cache_salt=salt)

    def _on_fp8_pool(self, model):
        """The model on ops that write and read the pool's e4m3 blocks and their scales, when it has them
        (``kv_cache_dtype="fp8"``: tritune.model.engine.kv_fp8)."""
        if self.pool.k_scales is None:
            return model
        from tritune.model.engine.kv_fp8 import Fp8KVOps

        p = self.pool
        model = model.with_ops(Fp8KVOps(model.ops, model.backend, p.k_caches, p.v_caches, p.k_scales, p.v_scales))
        self.notes.append(f"fp8 KV cache: {model.ops.steps['attention decode']}")
        return model

    def _init_stats(self) -> None:
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "graph_steps": 0,
                      "multi_steps": 0, "mixed_steps": 0, "preemptions": 0, "request_errors": 0}
        # host seconds per phase of step() (load/launch/wait: the graph path; forward: the others)
        self.timings = dict.fromkeys(("schedule_s", "forward_s", "load_s", "launch_s", "wait_s", "update_s"), 0.0)
        self.timings["tokens"] = 0
        self.gpu_timing = False     # True: CUDA events time the graph replays (stats["graph_gpu_s"])
        self.stats["graph_gpu_s"] = 0.0
        self.path_counts: Counter = Counter()     # steps per path (see the class docstring)

    # (the scheduler decides admission; these read its settings)
    @property
    def prefill_batching(self) -> bool:
        return self.scheduler.prefill_batching

    @property
    def prefill_min_seats(self) -> int:
        return self.scheduler.prefill_min_seats

    @property
    def prefill_max_wait(self) -> int:
        return self.scheduler.prefill_max_wait

    @property
    def model(self):
        """The model the engine runs (quantized when ``quant`` was given)."""
        return self.runner.model

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The device-side decode step (captured or eager), or None."""
        return self.runner.graphs

    # -------------------------------------------------------------------------------------- requests
    def _ids(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt: text needs a tokenizer (Engine(..., tokenizer=...)) or pass token ids")
            return self.tokenizer.encode(prompt)
        return prompt

    def add_request(self, prompt, sampling: SamplingParams | None = None, *, request_id=None, stream=None,
                    truncate: bool = False, arrival_time: float | None = None, priority: int = 0) -> Request:
        """Queue a request (text with a tokenizer, or token ids); it joins at the next step.

        ``stream``: callable(request, token) (token None at the end) or a queue (``put``). A bad request
        raises ValueError/TypeError and leaves every other request as it was; one that does not fit the
        context raises :class:`~tritune.model.engine.scheduler.ContextLimitError` (a ValueError).
        """
        if sampling is not None and sampling.stop and self.tokenizer is None:
            raise ValueError("sampling.stop: stop strings need a tokenizer (Engine(..., tokenizer=...))")
        return self.scheduler.add_request(self._ids(prompt), sampling, request_id=request_id, stream=stream,
                                          truncate=truncate, arrival_time=arrival_time, priority=priority)

    def stream(self, prompt, sampling: SamplingParams | None = None, **kw) -> TokenStream:
        """A :class:`TokenStream` over a new request's tokens (iterating it runs the engine)."""
        ts = TokenStream(self)
        ts.request = self.add_request(prompt, sampling, stream=ts, **kw)
        return ts

    def abort(self, request_id) -> Request:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts, sampling=None, *, errors: str = "raise", truncate: bool = False) -> list[Completion]:
        """Run a batch of prompts to completion; one Completion per prompt, in order.

        ``sampling``: one SamplingParams for all, or a list (one per prompt). ``errors="raise"``: a bad
        prompt raises ValueError/TypeError naming its index, before anything runs; ``"return"``: it gets a
        Completion with finish_reason "error" and the message, and the others run.
        """
        if errors not in ("raise", "return"):
            raise ValueError(f"errors: expected 'raise' or 'return', got {errors!r}")
        prompts = list(prompts)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(prompts):
                raise ValueError(f"sampling: {len(sampling)} SamplingParams for {len(prompts)} prompts")
            samplings = list(sampling)
        else:
            samplings = [sampling] * len(prompts)
        reqs, results = [], [None] * len(prompts)
        for i, (p, s) in enumerate(zip(prompts, samplings)):
            try:
                reqs.append((i, self.add_request(p, s, truncate=truncate)))
            except (ValueError, TypeError) as e:
                if errors == "raise":
                    for _, r in reqs:
                        self.scheduler.abort(r.id)
                    # the same exception, its message naming the prompt (a ContextLimitError keeps its
                    # numbers and describe(); its constructor takes those, not a message)
                    e.args = (f"prompts[{i}]: {e}", *e.args[1:])
                    raise e from None
                results[i] = Completion(None, [], [], "error", error=f"{type(e).__name__}: {e}")
        while any(not r.finished for _, r in reqs):
            self.step()
        for i, r in reqs:
            results[i] = completion_of(r, self.tokenizer)
        return results

    def run(self) -> None:
        """Step until every queued request has finished."""
        while self.scheduler.has_unfinished():
            self.step()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (those it started: collected, the group left);
        a no-op otherwise."""
        from tritune.model.parallel import serving as tp

        tp.engine_close(self.runner.model, self.tp_lead)

    def warm_up(self) -> float:
        """Compile the kernel variants a serving run meets, before it runs (seconds taken; see
        :meth:`~tritune.model.engine.runner.ModelRunner.warm_up`)."""
        return self.runner.warm_up(self.scheduler.max_num_batched_tokens, self.max_num_seqs)

    # -------------------------------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule, run one forward (or, on the graph path, up to ``decode_steps`` decode steps), sample,
        update. Returns the requests that finished. With ``run_ahead``, a step of decodes only on the
        device-side step returns with its steps queued: their tokens land at the start of the next call.

        A failure that belongs to one request (its token cannot be drawn, its stop strings cannot be checked
        on its text, its stream raises) ends that request alone with the error (finish_reason "error");
        the other rows of the step go on as if it were not there. A failure of the step itself (the
        forward) ends the step's requests and is raised."""
        landed = self._land() if self._ahead is not None else []
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out:
            return landed
        t1 = time.perf_counter()
        self.timings["schedule_s"] += t1 - t0
        if out.prefill:
            self.stats["prefill_tokens"] += sum(map(len, out.prefill_ids))
        self.stats["preemptions"] += len(out.preempted)
        try:
            finished = self._run(out, t1)
        except Exception as e:
            self._fail(out, e)
            raise
        if finished is None:        # queued on the device (run_ahead): landed by the next step()
            return landed
        return landed + self._retire(out, finished)

    def _run(self, out: SchedulerOutput, t1: float) -> list[Request] | None:
        """The step's forward(s) and update, on the path it takes; None when its steps were left queued."""
        st, tm = self.stats, self.timings
        if self.spec is not None and self.spec.applies(self, out):
            before = st["decode_tokens"]
            finished = self.spec.step(self, out)
            self.path_counts["spec"] += 1
            tm["tokens"] += st["decode_tokens"] - before
            return finished
        if self._graph_only(out):
            launched = self._graph_launch(out)
            if self.run_ahead:
                self._ahead = out, launched
                return None
            return self._graph_land(out, launched)
        logits, path = self.runner.forward(out)
        st["mixed_steps"] += path == "mixed"
        st["graph_steps"] += path == "graph"
        self.path_counts["graph+eager" if path == "graph" and out.prefill else path] += 1
        tokens = self.sampler(out.requests, logits)
        tm["forward_s"] += time.perf_counter() - t1
        failed = self._end_failed_rows()
        finished = failed + self.scheduler.update(out, tokens)
        st["steps"] += 1
        st["decode_tokens"] += len(out.decode)
        tm["tokens"] += len(out.decode)
        return finished

    def _end_failed_rows(self) -> list[Request]:
        """End each request whose token could not be drawn this step (the sampler's report, read after the
        step's sync): with the error, alone; update() then skips its row."""
        failed = []
        for req, e in self.sampler.failures():
            if not req.finished:
                self.end_request(req, e)
                failed.append(req)
        return failed

    def end_request(self, req: Request, e: BaseException) -> None:
        """End ``req`` alone with the error ``e`` (finish_reason "error"), its blocks freed: a failure that
        belongs to it (the rest of the step goes on)."""
        req.error = e
        self.stats["request_errors"] += 1
        self.scheduler.finish(req, "error")

    def _fail(self, out: SchedulerOutput, e: Exception) -> None:
        """The step's requests cannot go on (their caches are in an unknown state): end them with the
        error, free their blocks, and leave the engine usable for the rest."""
        self.scheduler.abandon_step()
        self.sampler.failures()     # (drop what the failed step drew)
        for req in out.scheduled:
            req.error = e
            self.scheduler.finish(req, "error")

    def _retire(self, out: SchedulerOutput, finished: list[Request]) -> list[Request]:
        """After a step's tokens are in: stop strings (checked on the text; a request whose text cannot be
        made or checked ends alone with the error), the finished requests' generators released."""
        t3 = time.perf_counter()
        if self.tokenizer is not None:
            for req in out.requests:
                if req.sampling.stop and req.state != FINISHED:
                    try:
                        text = self.tokenizer.decode(req.output_ids)
                        hit = any(s in text for s in req.sampling.stop)
                    except Exception as e:  # noqa: BLE001 (one request's text must not stop the others)
                        self.end_request(req, e)
                        finished.append(req)
                        continue
                    if hit:
                        self.scheduler.finish(req, "stop")
                        finished.append(req)
        for req in finished:
            self.sampler.release(req.id)
        self.timings["update_s"] += time.perf_counter() - t3
        return finished

    def _land(self) -> list[Request]:
        """The tokens of the decode steps the last step() queued (``run_ahead``): one sync, then update."""
        out, launched = self._ahead
        self._ahead = None
        try:
            finished = self._graph_land(out, launched)
        except Exception as e:
            self._fail(out, e)
            raise
        return self._retire(out, finished)

    # -------------------------------------------------------------------------------------- graph decode
    def _graph_only(self, out: SchedulerOutput) -> bool:
        """A step of decodes only, in a bucket of the device-side step: the device picks (greedy) or draws
        (sampled rows, between replays) each token and feeds it back."""
        return not out.prefill and self.runner.graph_batch(len(out.decode))

    def _num_steps(self, out: SchedulerOutput) -> int:
        """How many decode steps to run before the host looks at the tokens again (the scheduler's
        :meth:`~tritune.model.engine.scheduler.Scheduler.run_length`; 1 where stop strings are checked on
        the host after every token)."""
        if self.decode_steps == 1 or (self.tokenizer is not None and any(r.sampling.stop for r in out.decode)):
            return 1
        return self.scheduler.run_length(out, self.decode_steps)

    def _graph_launch(self, out: SchedulerOutput):
        """Queue up to ``decode_steps`` decode steps of ``out`` on the device-side step (no host sync)."""
        K = self._num_steps(out)
        reqs, pos = out.decode, out.decode_positions
        ids = contract.eos_ids(self.model)
        eos = ids if len(ids) > 1 else ids[0] if ids else None    # every id a row stops at (Llama-3: several)
        stops = [p + min(K, r.tokens_left) for r, p in zip(reqs, pos)]
        # a sampled row's EOS is the drawn token's, seen by update() on the host (the device checks the greedy one)
        eoss = [-1 if eos is None or r.sampling.ignore_eos or r.sampling.temperature else eos for r in reqs]
        draw = None
        if any(r.sampling.temperature for r in reqs):
            def draw(logits):
                return self.sampler.draw(reqs, logits)
        return K, self.runner.graph_launch(out.decode_ids, pos, stops, eoss, out.decode_tables, K,
                                           gpu_timing=self.gpu_timing, draw=draw)

    def _graph_land(self, out: SchedulerOutput, launched) -> list[Request]:
        """Read the queued steps' tokens with one sync; update with every token."""
        tm = self.timings
        K, handle = launched
        rows, host, gpu_s = self.runner.graph_collect(handle)
        t3 = time.perf_counter()
        if gpu_s is not None:
            self.stats["graph_gpu_s"] += gpu_s
        reqs = out.decode
        before = sum(len(r.output_ids) for r in reqs)
        failed = self._end_failed_rows()
        finished = failed + self.scheduler.update_steps(out, rows)
        st = self.stats
        n = sum(len(r.output_ids) for r in reqs) - before
        st["decode_tokens"] += n
        tm["tokens"] += n
        st["steps"] += K
        st["graph_steps"] += K
        self.path_counts["graph"] += K
        st["multi_steps"] += K > 1
        for k, v in host.items():
            tm[k] += v
        tm["update_s"] += time.perf_counter() - t3
        return finished

    # -------------------------------------------------------------------------------------- reports
    def describe(self) -> dict:
        return {"backend": self.model.backend, "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "quant": self.quant, "cuda_graphs": self.graphs is not None,
                "compile": self.runner.compiled is not None, "batch_invariant": self.batch_invariant,
                "run_ahead": self.run_ahead, "graph_prefill_tokens": self.runner.graph_prefill_tokens,
                "graph_prefill_work": self.scheduler.decode_step_prefill_work,
                "long_prefill_token_threshold": self.scheduler.long_prefill_token_threshold,
                "num_blocks": self.pool.num_blocks,
                "block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                "max_batch_tokens": self.scheduler.max_num_batched_tokens, "chunked_prefill": self.scheduler.chunked,
                "prefill_batching": self.prefill_batching,
                "prefill_min_seats": self.prefill_min_seats, "prefill_max_wait": self.prefill_max_wait,
                "notes": list(self.notes)}
