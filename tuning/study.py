"""The study API: one Optuna study per (kernel, bucket, dtype key, GPU slug), in a storage (a journal file
by default, any RDB URL otherwise) that several processes or machines may share.

Open storages and studies, plan the studies a command means (:func:`plan`), enqueue seeds (the heuristic
default first: the baseline; the store's entry; given configs: :func:`ensure_seeds`, :func:`enqueue_seeds`),
read evaluated trials (:func:`evaluated`; :func:`current_trials`: those timed on the kernel's current
code), fail and retry the trials of dead processes (:func:`reap`), and read a study back
(:func:`study_stats`, :func:`tuned_studies`). Trial outcomes: ``COMPLETE`` (verified and timed, µs),
``FAIL`` + ``error`` (the evaluation's reason), ``PRUNED`` + ``invalid`` (nothing launched); a trial's
``evaluated`` attribute records its input seed, worker, seconds and code version.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import socket
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCALARS = (bool, int, float, str, type(None))
SEED_ATTRS = ("default", "previous", "warm", "seeded")   # the user attributes of a study's seed trials


def default_storage() -> str:
    from tritune.kernels.runtime import device as dev

    return os.environ.get("TRITUNE_STUDIES") or str(dev.cache_dir("the studies journal") / "tuning-studies.journal")


class StorageError(ValueError):
    """A storage that cannot be opened: the message names it and says why, in one line."""


STORAGE_HELP = ("Optuna storage: a journal file (e.g. ./studies.journal), or an RDB URL: sqlite:///studies.db, "
                "postgresql+psycopg2://USER@127.0.0.1:5432/DB (pip install 'tritune[postgres]')")


def open_storage(url=None):
    """A journal file (any path), or any Optuna RDB URL (``sqlite:///...``, ``postgresql://...``); a
    storage that cannot be opened raises :class:`StorageError` naming it and the reason."""
    import optuna

    if url is None:
        url = default_storage()
    if not isinstance(url, (str, os.PathLike)):
        return url  # already a storage object
    url = str(url)
    if "://" in url:
        kw = {}
        if url.startswith("sqlite"):
            kw["engine_kwargs"] = {"connect_args": {"timeout": 120}}
        # heartbeats fail the trials of a process on another machine that stopped beating (this
        # machine's dead processes are found at once by their pid: see reap)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # heartbeat_interval is experimental in Optuna
                return optuna.storages.RDBStorage(url, heartbeat_interval=60, grace_period=300, **kw)
        except ModuleNotFoundError as e:
            hint = " (pip install 'tritune[postgres]')" if url.startswith("postgres") else ""
            raise StorageError(f"storage {url}: the database driver is not installed: {e}{hint}") from None
        except Exception as e:  # SQLAlchemy's errors: bad URL, unknown dialect, no server, no such directory
            first = (str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__])[0]
            raise StorageError(f"storage {url}: cannot open it: {first[:300]}") from None
    path = Path(url).expanduser()
    if path.is_dir():
        raise StorageError(f"storage {url}: is a directory; give a journal file path inside it, "
                           f"e.g. {path / 'studies.journal'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        raise StorageError(f"storage {url}: cannot write a journal file there: {e.strerror or e}") from None
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def check_seed_configs(specs, configs) -> None:
    """ValueError for a seed config that is not a JSON object, or names a parameter no kernel being tuned
    has (a typo would otherwise be skipped without a word)."""
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise ValueError("seed configs must be a JSON list of config objects, e.g. [{\"BLOCK\": 1024}]")
    known = set().union(*(s.space.params for s in specs)) if specs else set()
    for i, c in enumerate(configs):
        bad = sorted(set(c) - known)
        if bad:
            names = ", ".join(s.name for s in specs)
            raise ValueError(f"seed config {i} {c}: unknown parameter {bad[0]!r} for {names} "
                             f"(parameters: {', '.join(sorted(known))})")


def dtype_name(dtype) -> str:
    from tritune.kernels.runtime.store import dtype_name as name

    return name(dtype)


def store_key(dtype) -> str:
    """The store's (and a study's) dtype key: fp32 under tf32 precision is "tfloat32" where the kernels
    package keys it so (``kernels.store_dtype``), the dtype's name otherwise."""
    from tritune import kernels

    fn = getattr(kernels, "store_dtype", None)
    return fn(dtype) if fn is not None else dtype_name(dtype)


def study_name(kernel: str, bucket: str, dtype, slug: str, params: dict | None = None) -> str:
    """kernel:bucket:dtype:slug, and with the space's parameters a short hash of their names and choices:
    Optuna keeps one set of choices per parameter and study, so a kernel whose space gained a value (a new
    version) continues in a study of its own instead of failing on the old one's trials."""
    name = f"{kernel}:{bucket}:{dtype_name(dtype)}:{slug}"
    if params:
        sig = json.dumps(sorted((k, list(v)) for k, v in params.items()), default=str)
        name += f":space-{zlib.crc32(sig.encode()) & 0xFFFFFFFF:08x}"
    return name


def config_key(config: dict, params: dict | None) -> str:
    keys = list(params) if params is not None else sorted(config)
    return json.dumps([[k, config.get(k)] for k in sorted(keys)])


def seed_for(*parts) -> int:
    """A stable seed from names and numbers (a sampler's, a trial's inputs')."""
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------------------
# The plan: which studies a command means
# ---------------------------------------------------------------------------------------------------
@dataclass
class Job:
    spec: Any
    problem: Any
    dtype: Any
    slug: str
    bucket: str = ""
    name: str = ""
    skipped: list = field(default_factory=list)   # further problems of the same bucket
    key: str = ""           # the store's dtype key (fp32 under tf32 precision: "tfloat32")

    def __post_init__(self):
        from tritune import kernels

        self.bucket = self.bucket or kernels.bucket_key(self.spec.bucket(self.problem))
        self.key = self.key or store_key(self.dtype)
        self.name = self.name or study_name(self.spec.name, self.bucket, self.key, self.slug,
                                            getattr(getattr(self.spec, "space", None), "params", None))

    def label(self) -> str:
        return f"{self.spec.name} {self.bucket} {self.key}"


def resolve_specs(kernels_) -> list:
    """Names, 'all', or spec objects -> specs."""
    from tritune import kernels

    if isinstance(kernels_, str):
        kernels_ = [kernels_]
    out = []
    for k in kernels_:
        if isinstance(k, str):
            out += kernels.all_specs() if k == "all" else [kernels.get(k)]
        else:
            out.append(k)
    return out


def plan(specs, problems=None, dtypes=None, slug: str | None = None, log=None) -> list[Job]:
    """One job per (kernel, bucket, dtype): the first given problem of each bucket is the one tuned."""
    from tritune.kernels.runtime import device as dev

    slug = slug or dev.gpu_slug()
    log = log or (lambda msg: None)
    jobs = []
    for spec in specs:
        probs = problems if problems is not None else (
            spec.small_problems if dev.interpreted() else spec.standard_problems)
        if not probs:
            log(f"{spec.name}: no problems to tune")
            continue
        if any(not all(isinstance(c, SCALARS) for c in v) for v in spec.space.params.values()):
            log(f"{spec.name}: skipped: space choices must be scalars (int, float, str, bool) to be stored")
            continue
        for dt in (dtypes or spec.dtypes):
            if dt not in spec.dtypes:
                log(f"{spec.name}: skipping dtype {dtype_name(dt)} (supported: "
                    f"{', '.join(map(dtype_name, spec.dtypes))})")
                continue
            if dev.interpreted() and dt in spec.interpreter_skip:
                log(f"{spec.name}: skipping {dtype_name(dt)} on the interpreter: {spec.interpreter_skip[dt]}")
                continue
            by_bucket: dict[str, Job] = {}
            for p in probs:
                j = Job(spec, p, dt, slug)
                if j.bucket in by_bucket:
                    by_bucket[j.bucket].skipped.append(p)
                    log(f"{spec.name}: {p} shares bucket {j.bucket} with {by_bucket[j.bucket].problem}; "
                        "one config per bucket: tuning the first")
                else:
                    by_bucket[j.bucket] = j
            jobs += by_bucket.values()
    return jobs


# ---------------------------------------------------------------------------------------------------
# One study
# ---------------------------------------------------------------------------------------------------
def problem_dict(problem) -> dict:
    if dataclasses.is_dataclass(problem):
        return {k: v for k, v in dataclasses.asdict(problem).items() if isinstance(v, SCALARS)}
    return {"repr": repr(problem)}


def problem_label(problem) -> str:
    from tritune.tuning import timing

    return timing.problem_label(problem)


def open_study(storage, job: Job, sampler=None):
    """Create or load the study of a job (safe when several processes do it at once)."""
    import optuna

    study = optuna.create_study(study_name=job.name, storage=storage, direction="minimize",
                                sampler=sampler, load_if_exists=True)
    attrs = study.user_attrs
    if attrs.get("kernel") != job.spec.name:
        default = job.spec.default_config(job.problem, job.dtype)
        for k, v in {
            "tritune": 1, "kernel": job.spec.name, "bucket": job.bucket, "dtype": job.key,
            "slug": job.slug, "problem": problem_dict(job.problem), "problem_label": problem_label(job.problem),
            "default_config": default,
            "n_valid": len(job.spec.space.points(job.problem, job.dtype)),
        }.items():
            study.set_user_attr(k, v)
    elif attrs.get("problem") not in (None, problem_dict(job.problem)) and dataclasses.is_dataclass(job.problem):
        # measurements in one study must be of one problem: keep the one the study started with
        try:
            old = type(job.problem)(**attrs["problem"])
        except TypeError:
            old = None
        if old is not None:
            print(f"tritune: study {job.name} was started on {attrs.get('problem_label')}; continuing with it "
                  f"(not {problem_label(job.problem)})", file=sys.stderr)
            job.problem = old
    return study


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def evaluated(trials) -> list:
    """Trials whose evaluation finished: complete, or failed with the evaluation's reason. A trial that
    failed without one was abandoned (its process died after timing it, before telling the storage): it
    does not count, and it is retried."""
    from optuna.trial import TrialState

    return [t for t in trials if t.user_attrs.get("evaluated") and t.state.is_finished()
            and (t.state != TrialState.FAIL or "error" in t.user_attrs)]


# ---------------------------------------------------------------------------------------------------
# Trials of dead processes: failed, then retried once
# ---------------------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not waited for yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def is_dead(t, now: float, window: float) -> bool:
    """A RUNNING trial whose process is gone: its owner (host:pid) is on this host and not alive, or it
    started longer ago than any evaluation may take (another host's, or one killed before it said who
    owns it)."""
    owner = t.user_attrs.get("owner")
    if isinstance(owner, str) and ":" in owner:
        host, _, pid = owner.rpartition(":")
        if host == socket.gethostname() and pid.isdigit():
            return int(pid) != os.getpid() and not _pid_alive(int(pid))
    start = t.datetime_start.timestamp() if t.datetime_start is not None else now
    return now - start > window


# a retried trial keeps its role: a seed's, or tune all --budget's local-search and nearest-bucket marks
_CARRIED = ("default", "previous", "seeded", "warm", "forced", "local", "local_of", "bucket_seed")


def reap(study, window: float) -> int:
    """Fail the RUNNING trials of dead processes (a ``kill -9``, a crash, a lost machine) and enqueue
    each abandoned trial's config once again, with its role (default, seeded, ...): after a kill the
    study still reaches its trial count, and no finished evaluation is repeated. ``window``: seconds
    after which a trial of an unknown or remote process counts as dead. Returns how many were failed.
    RDB storages also fail trials whose heartbeat stopped (Optuna's ``fail_stale_trials``)."""
    import optuna
    from optuna.trial import TrialState

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental since Optuna 2.9
            optuna.storages.fail_stale_trials(study)
    except Exception:  # a storage without heartbeats, or a race with another worker: ours below suffices
        pass
    storage = study._storage
    now = time.time()
    n = 0
    ts = study.get_trials(deepcopy=False)
    for t in ts:
        if t.state != TrialState.RUNNING or not is_dead(t, now, window):
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "abandoned", f"process gone ({t.user_attrs.get('owner', '?')})")
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError):
            pass  # it finished after all, or another worker reaped it first
    if n:
        ts = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in ts}
    for t in ts:
        launched_nothing = any(k in t.user_attrs for k in ("duplicate_of", "busy_with", "invalid"))
        abandoned = (t.state == TrialState.FAIL and "error" not in t.user_attrs and not launched_nothing
                     and "retry_of" not in t.user_attrs and t.params)
        if abandoned and t.number not in retried:
            attrs = {k: t.user_attrs[k] for k in _CARRIED if k in t.user_attrs}
            study.enqueue_trial(dict(t.params), user_attrs={**attrs, "retry_of": t.number},
                                skip_if_exists=False)
            retried.add(t.number)
    return n


def code_version(kernel: str) -> str | None:
    """The kernel's jitted-code hash (``store.source_hash``): each evaluated trial records it."""
    from tritune.kernels.runtime import store

    return store.source_hash(kernel)


def _trial_source(t, by_number: dict) -> str | None:
    """The code version a trial was timed on: its own record, or (a repeat of an earlier config) that
    trial's. Trials from before versions were recorded have none."""
    for _ in range(8):
        ev = t.user_attrs.get("evaluated")
        if isinstance(ev, dict):
            return ev.get("source")
        prev = t.user_attrs.get("duplicate_of")
        if prev is None or prev not in by_number:
            return None
        t = by_number[prev]
    return None


def current_trials(trials, version: str | None) -> list:
    """The trials timed on this version of the kernel's code (all of them when the version is unknown).
    A study continued after the kernel changed keeps its old trials for the sampler, but none of them is
    reused as a result, exported or counted: they measured other code."""
    if version is None:
        return list(trials)
    by_number = {t.number: t for t in trials}
    return [t for t in trials if _trial_source(t, by_number) == version]


def by_config(trials, params) -> dict:
    """Evaluated trials by config key: the first of each config, or its first complete one."""
    from optuna.trial import TrialState

    done: dict[str, Any] = {}
    for t in trials:
        k = config_key(t.params, params)
        if k not in done or (done[k].state != TrialState.COMPLETE and t.state == TrialState.COMPLETE):
            done[k] = t
    return done


def _ensure_default(study, job: Job) -> None:
    """Enqueue the heuristic default as a trial (once): its time is the baseline, and tuning can only
    improve on it."""
    from optuna.trial import TrialState

    default = job.spec.default_config(job.problem, job.dtype)
    if job.spec.space.why_invalid(default, job.problem, job.dtype):
        if "default_error" not in study.user_attrs:
            study.set_user_attr("default_error", "default config invalid: " +
                                job.spec.space.why_invalid(default, job.problem, job.dtype))
        return
    all_ts = study.get_trials(deepcopy=False)
    current = {t.number for t in current_trials(all_ts, code_version(job.spec.name))}
    for t in all_ts:
        if t.user_attrs.get("default") and (t.state in (TrialState.WAITING, TrialState.RUNNING)
                                            or (t.number in current and (t.user_attrs.get("evaluated")
                                                                         or "duplicate_of" in t.user_attrs))):
            return
    study.enqueue_trial(default, user_attrs={"default": True})


def _ensure_previous(study, job: Job) -> None:
    """Enqueue the store's entry for the job's bucket (once), stale or not: after an edit to the kernel's
    code, the config that won on the code before is the likeliest winner still, so the study times it
    again on the current code rather than hoping its sampler finds it."""
    from tritune.kernels.runtime import store

    try:
        prev = store.entry_config(job.spec.name, job.bucket, job.key, job.slug)
    except Exception:  # an unreadable store is reported where it is loaded
        return
    if prev is not None and prev != job.spec.default_config(job.problem, job.dtype):
        enqueue_seeds(study, job, [prev], attr="previous")


def ensure_seeds(study, job: Job) -> None:
    """Every study's own seeds, each enqueued once: the heuristic default, the store's entry for its bucket
    and the spec's seeds (``KernelSpec.seeds``, as seeded trials)."""
    _ensure_default(study, job)
    _ensure_previous(study, job)
    if job.spec.seeds is not None:
        enqueue_seeds(study, job, list(job.spec.seeds(job.problem, job.dtype)))


def enqueue_seeds(study, job: Job, configs: list[dict], attr: str = "seeded") -> int:
    """Enqueue each of ``configs`` (completed from the default) that is valid for the job and not yet
    waiting, running or timed on the current code under ``attr`` (the trial's user attribute, holding
    the config's key); returns how many were enqueued."""
    from optuna.trial import TrialState

    params = job.spec.space.params
    default = job.spec.default_config(job.problem, job.dtype)
    all_ts = study.get_trials(deepcopy=False)
    current = {t.number for t in current_trials(all_ts, code_version(job.spec.name))}
    have = {t.user_attrs.get(attr) for t in all_ts
            if t.state in (TrialState.WAITING, TrialState.RUNNING) or t.number in current}
    n = 0
    for cfg in configs:
        full = dict(default, **cfg)
        key = config_key(full, params)
        if key in have or job.spec.space.why_invalid(full, job.problem, job.dtype):
            continue
        study.enqueue_trial(full, user_attrs={attr: key})
        have.add(key)
        n += 1
    return n


def record_default(study) -> None:
    s = study_stats(study)
    if s.get("default_us") is not None and study.user_attrs.get("default_us") != s["default_us"]:
        study.set_user_attr("default_us", s["default_us"])
    if s.get("default_error") and study.user_attrs.get("default_error") != s["default_error"]:
        study.set_user_attr("default_error", s["default_error"])


# ---------------------------------------------------------------------------------------------------
# Reading studies back
# ---------------------------------------------------------------------------------------------------
def study_stats(study) -> dict:
    """What a study found: best verified config and time, the default's time, trials and failures."""
    from optuna.trial import TrialState

    a = study.user_attrs
    all_ts = study.get_trials(deepcopy=False)
    ts = current_trials(all_ts, code_version(a["kernel"]) if a.get("kernel") else None)
    ev = evaluated(ts)
    failed = [t for t in ev if t.state == TrialState.FAIL]
    complete = [t for t in ts if t.state == TrialState.COMPLETE and t.value is not None]
    default_cfg = a.get("default_config")
    best = min(complete, key=lambda t: (t.value, t.number)) if complete else None
    default_us = default_error = None
    for t in sorted(ts, key=lambda t: t.number):
        is_default = t.user_attrs.get("default") or (default_cfg is not None and dict(t.params) == default_cfg)
        if not is_default:
            continue
        if t.state == TrialState.COMPLETE and t.value is not None:
            default_us = t.value
            break
        if t.state == TrialState.FAIL and (t.user_attrs.get("evaluated") or "duplicate_of" in t.user_attrs):
            default_error = t.user_attrs.get("error", "failed")
    if default_us is not None:
        default_error = None
    elif default_error is None:
        default_error = a.get("default_error")
    reasons = collections.Counter(str(t.user_attrs.get("error", "failed")).split(":")[0] for t in failed)
    return {
        "study": study.study_name, "kernel": a.get("kernel"), "bucket": a.get("bucket"), "dtype": a.get("dtype"),
        "slug": a.get("slug"), "problem": a.get("problem_label"), "problem_fields": a.get("problem"),
        "n_valid": a.get("n_valid"),
        "trials": len(ev), "failed": len(failed), "free": len(all_ts) - len(evaluated(all_ts)),
        "stale_trials": len(evaluated(all_ts)) - len(ev),
        "best_us": best.value if best else None, "config": dict(best.params) if best else None,
        "best_trial": best.number if best else None,
        "default_us": default_us, "default_config": default_cfg, "default_error": default_error,
        "speedup": (default_us / best.value) if (best and default_us) else None,
        "failure_kinds": dict(reasons),
        "workers": sorted({t.user_attrs["evaluated"]["worker"] for t in ev
                           if isinstance(t.user_attrs["evaluated"], dict) and "worker" in t.user_attrs["evaluated"]}),
    }


def tuned_studies(storage, kernel: str | None = None, slug: str | None = None) -> list:
    """Every tritune study in ``storage`` (optionally of one kernel and GPU slug), as loaded studies."""
    import optuna

    out = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        a = s.user_attrs
        if not a.get("tritune"):
            continue
        if kernel is not None and a.get("kernel") != kernel:
            continue
        if slug is not None and a.get("slug") != slug:
            continue
        out.append(optuna.load_study(study_name=s.study_name, storage=storage))
    return sorted(out, key=lambda st: st.study_name)
