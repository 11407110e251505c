"""Probe (CPU, no GPU needed): do a kernel module's stored configs still compile to the same code as on the
commit they were tuned on? If so, restamp them with the current source hash.

tuning/store.py stamps every entry with the sha256 of its kernel module's ``@triton.jit`` sources, and
skips entries whose stamp is not the current code's ("tuned against another version"). An edit that only
adds constexpr branches (new config points) changes that hash although the stored points may compile to
the same code. This probe checks it entry by entry, under one compiler, and restamps only what it proved:

1. the module's source at ``--old`` (``git show <commit>:<path>``, or ``--old-file``) is loaded beside the
   current one as its own module (its specs are not registered);
2. each stored entry's launch is made by each version's own launcher (``spec.run`` on the entry's problem,
   inputs from ``make_inputs`` on the CPU, ``out=``, the entry's config, as tuning and the benchmarks
   call it), with Triton's active driver swapped for a CPU stand-in targeting sm90 and ``JITFunction.run``
   forced to ``warmup=True``: Triton's own binder computes signature and specialization, and the kernel
   compiles (to cubin) without launching;
3. old and new are compared at three levels, each normalised: TTIR (locations gone, SSA values renumbered),
   PTX (kernel name, comments, blank lines and debug info gone: ``.loc``, ``.file``, ``.section .debug_*``
   and the ``$L__tmp`` labels they use; each ``<kernel>_param_<i>`` renamed to the argument it carries, as
   new arguments move the numbering; a parameter one side declares and never reads is dropped, and the
   line says so) and SASS (cuobjdump; parameter reads ``c[0x0][off]`` named by argument), plus the launch
   metadata (shared memory, warps, stages, scratch). One line per entry, with the first differing lines;
4. ``--write``: a file whose every entry carries the old commit's hash and is the same at ``--level``
   (default ``ptx``) gets that hash replaced by the current one in its ``source`` fields, nothing else
   changed (the file must round-trip through ``json.dumps(indent=1)``, the store writer's format).
   ``store.write`` is not used: it re-dates the file and stamps this machine's GPU name, triton and torch.

Which level: the same TTIR (Triton's own output, before any backend) would hold under every triton
version; the same PTX or SASS holds only for the triton that made it (LLVM and ptxas differ between
versions: for the attention change of 7a0514c..12718f8, PTX equal under triton 3.6 differed under 3.9).
So ``--write`` at ``ptx`` (default) or ``sass`` needs the triton version the file was
tuned with (its "triton" field): run the probe under that triton (on the CPU: ``pip install --target DIR
--no-deps triton==3.6.0`` and ``PYTHONPATH=DIR``). ``--ab`` (GPU) times old against new code per entry
and checks their outputs are bitwise equal: evidence for a person, never acted on by ``--write``.

  python lab/probes/same_code_restamp.py --old 4d69c61 --out DIR        # attention + attention_varlen, every GPU
  python lab/probes/same_code_restamp.py --old 4d69c61 --write
  PYTHONPATH=DIR python lab/probes/same_code_restamp.py --old 4d69c61 --write     # DIR: triton 3.6, as tuned
  python lab/probes/same_code_restamp.py --old 4d69c61 --slugs nvidia-h100-80gb-hbm3 --ab different --out DIR  # GPU
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions (tritune.harness keeps an explicit setting)

import argparse  # noqa: E402
import ast  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import difflib  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import jit as triton_jit  # noqa: E402
from triton.runtime.driver import driver as triton_driver  # noqa: E402

import tritune.kernels as K  # noqa: E402
from tritune.harness import device as dev  # noqa: E402
from tritune.tuning import store  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
META_KEYS = ("num_warps", "num_ctas", "num_stages", "shared", "global_scratch_size", "global_scratch_align",
             "profile_scratch_size", "profile_scratch_align", "maxnreg", "cluster_dims")


class CpuSm90Driver:
    """Triton's active driver, for compiling only: an sm90 target, device 0, a null stream."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(arch: int, launches: list):
    """Every ``kernel[grid](...)`` inside compiles for sm<arch> (warmup) and appends (name, compiled)."""
    real_run = triton_jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        launches.append((self.fn.__name__, kernel))
        return kernel

    # the launchers check that tensors are on the kernels' device ("cuda" off the interpreter)
    real_device, dev.device = dev.device, lambda: "cpu"
    prev_driver = triton_driver._active  # reset_active() would look for a real GPU driver
    triton_driver.set_active(CpuSm90Driver(arch))
    triton_jit.JITFunction.run = run
    try:
        yield
    finally:
        triton_jit.JITFunction.run = real_run
        triton_driver._active = prev_driver
        dev.device = real_device


def module_path(modname: str) -> str:
    return modname.split(".", 1)[1].replace(".", "/") + ".py"  # tritune.kernels.attention -> kernels/attention.py


_HELPER = re.compile(r"^from (tritune\.kernels) import (_\w+) as (\w+)$", re.M)


def _module_from_text(name: str, text: str, path: Path):
    """Module ``name`` made from ``text``, written to ``path`` (triton reads jitted functions' source from
    their file), registered in sys.modules but not yet executed: (module, its loader spec)."""
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    return mod, spec


def load_old_helpers(src: str, commit: str, tmpdir: Path, from_git: bool) -> str:
    """The private modules of the kernels package that ``src`` imports (``from tritune.kernels import
    _attention_gluon as G``: code its kernels launch, counted in the source hash) loaded at ``commit`` beside
    the current ones, and ``src`` rewritten to import those; without git (``--old-file``) the current ones."""
    def swap(m):
        pkg, helper, alias = m.groups()
        if not from_git:
            return m.group(0)
        text = subprocess.run(["git", "show", f"{commit}:{module_path(f'{pkg}.{helper}')}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        name = f"{pkg}.{helper}_at_{commit}"
        mod, spec = _module_from_text(name, text, tmpdir / f"{helper}_at_{commit}.py")
        spec.loader.exec_module(mod)
        return f"import {name} as {alias}"
    return _HELPER.sub(swap, src)


def load_old_module(modname: str, commit: str, src: str, tmpdir: Path, from_git: bool = True):
    """``src`` (the module at ``commit``) loaded as ``<modname>_at_<commit>`` from a file (triton reads
    the source of jitted functions), with its private helper modules at ``commit`` too
    (:func:`load_old_helpers`); the specs it registers are returned, not registered."""
    src = load_old_helpers(src, commit, tmpdir, from_git)
    name = f"{modname}_at_{commit}"
    mod, spec = _module_from_text(name, src, tmpdir / f"{name.rsplit('.', 1)[1]}.py")
    specs = {}
    real_register = K.register
    K.register = lambda s: specs.setdefault(s.name, s)
    try:
        spec.loader.exec_module(mod)
    finally:
        K.register = real_register
    return mod, specs


def prime_device_queries(mod, arch: int):
    """The launchers' constraint checks ask torch.cuda for the capability and shared-memory budget:
    answer as an sm90 (227 KiB opt-in, H100 and H200 alike) without a GPU."""
    if isinstance(getattr(mod, "_CAP", None), list) and not mod._CAP:
        mod._CAP.append((arch // 10, arch % 10))
    if isinstance(getattr(mod, "_SMEM", None), list) and not mod._SMEM:
        mod._SMEM.append(227 * 1024)


_FIELD = re.compile(r"(\w+)=(\([^)]*\)|\S+)")


def entry_problem(spec, e: dict):
    """The problem an entry was tuned on: ``problem_fields``, else its ``problem`` string
    (``B=1 Hq=16 ... causal=True``, tuples allowed), else the store's own rule (a standard problem in its bucket)."""
    cls = type((list(spec.standard_problems or []) + list(spec.small_problems or []))[0])
    if isinstance(e.get("problem_fields"), dict):
        names = {f.name for f in dataclasses.fields(cls)}
        if set(e["problem_fields"]) == names:
            return cls(**e["problem_fields"])
    if isinstance(e.get("problem"), str):
        fields = {k: ast.literal_eval(v) for k, v in _FIELD.findall(e["problem"])}
        try:
            p = cls(**fields)
        except TypeError:
            p = None
        if p is not None and store.bucket_key_of(spec, p) == e["bucket"]:
            return p
    return store.problem_of_entry(spec, e)


def compile_launches(spec, dtype_key: str, config: dict, case, arch: int) -> list:
    launches = []
    prec = torch.get_float32_matmul_precision()
    if dtype_key == "tfloat32":
        torch.set_float32_matmul_precision("high")
    try:
        with compile_only(arch, launches):
            spec.run(*case.args, out=case.out, config=dict(config), **case.kwargs)
    finally:
        torch.set_float32_matmul_precision(prec)
    return launches


def runtime_params(kernel) -> list[str]:
    """The names of the kernel's PTX parameters in order: arguments that are neither constexpr nor
    specialized to a constant (Triton's scratch pointers follow them)."""
    consts = {p[0] if isinstance(p, tuple) else p for p in kernel.src.constants}
    return [n for i, (n, t) in enumerate(kernel.src.signature.items()) if t != "constexpr" and i not in consts]


_PARAM = re.compile(r"\b(\w+)_param_(\d+)\b")
_SSA = re.compile(r"%[A-Za-z_][\w.$-]*|%\d+")


def _param_name(params: list[str], i: int) -> str:
    return f"%ARG.{params[i]}" if i < len(params) else f"%ARG.scratch{i - len(params)}"


def normalize_ptx(ptx: str, kernel, fn_name: str) -> tuple[list[str], set]:
    """PTX lines with comments, debug info and the kernel name gone and parameters named by argument;
    returns (lines, declared parameter names)."""
    params = runtime_params(kernel)
    text = re.sub(r"/\*.*?\*/", "", ptx, flags=re.S)
    text = re.sub(r"\.section\s+\.debug_\w+\s*\{.*?\n\s*\}", "", text, flags=re.S)
    lines, declared = [], set()
    for line in text.splitlines():
        line = line.split("//", 1)[0].rstrip()
        s = line.strip()
        if not s or s.startswith((".loc", ".file")) or re.fullmatch(r"\$L__tmp\d+:", s):
            continue  # $L__tmp labels mark source lines for the debug sections only
        line = _PARAM.sub(lambda m: _param_name(params, int(m.group(2))), line)
        line = re.sub(rf"\b{re.escape(fn_name)}\b", "KERNEL", line)
        if s.startswith(".param") and "%ARG." in line:
            declared.add(re.search(r"%ARG\.\w+", line).group(0))
            line = line.rstrip(",")  # the list's last comma moves with a dropped parameter
        lines.append(line)
    return lines, declared


def drop_unread(lines: list[str], names: set) -> tuple[list[str], list[str], list[str]]:
    """Lines without the declarations of ``names`` that the body never reads; (lines, dropped, read)."""
    def decl_of(ln):
        m = re.search(r"%ARG\.\w+$", ln) if ln.strip().startswith(".param") else None
        return m.group(0) if m else None

    read = sorted(n for n in names if any(re.search(rf"{re.escape(n)}\b", ln) for ln in lines if not decl_of(ln)))
    drop = set(names) - set(read)
    return [ln for ln in lines if decl_of(ln) not in drop], sorted(drop), read


def normalize_ttir(ttir: str, fn_name: str) -> list[str]:
    """TTIR without locations, the signature line, and SSA values renumbered by first use (their names
    come from the Python variables, which a refactor renames)."""
    out, names = [], {}
    for line in ttir.splitlines():
        if line.startswith("#loc") or "tt.func public" in line:
            continue
        line = re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", line)
        line = _SSA.sub(lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), line)
        out.append(line.replace(fn_name, "KERNEL"))
    return out


def _tool(name: str) -> str | None:
    import shutil

    cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(cand) if cand.exists() else shutil.which(name)


PARAM_BASE = 0x210  # sm90's kernel parameters start at c[0x0][0x210]


def normalize_sass(kernel, fn_name: str) -> list[str] | None:
    """cuobjdump's SASS without addresses and encodings, the kernel name gone and constant-bank reads of
    parameters (c[0x0][off]) named by argument (offsets from the PTX parameter list); None without cuobjdump."""
    tool = _tool("cuobjdump")
    if tool is None:
        return None
    params = runtime_params(kernel)
    layout, off = [], PARAM_BASE
    for m in re.finditer(r"\.param\s+\.(u64|u32|f32|b32|b64|s32|s64)\b[^\n]*?_param_(\d+)", kernel.asm["ptx"]):
        size = 8 if m.group(1).endswith("64") else 4
        off = (off + size - 1) // size * size
        layout.append((off, size, _param_name(params, int(m.group(2)))))
        off += size

    def cbank(m):
        x = int(m.group(1), 16)
        for start, size, name in layout:
            if start <= x < start + size:
                return f"c[0x0][{name}{'+%d' % (x - start) if x > start else ''}]"
        return m.group(0)

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout
    out = []
    for line in text.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip()
        if not line or line.startswith(("code for", "Fatbin", "Function", ".")) or fn_name in line:
            continue
        out.append(re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", cbank, line))
    return out


def _diff(a: list[str], b: list[str], n: int = 12) -> list[str]:
    d = [x for x in difflib.unified_diff(a, b, "old", "new", n=0, lineterm="") if not x.startswith(("---", "+++"))]
    return [f"{len(a)} vs {len(b)} lines, {sum(x[0] in '+-' for x in d)} differ"] + ["    " + x for x in d[:n]]


LEVELS = ("ttir", "ptx", "sass")


def compare(old_launches, new_launches) -> dict:
    """Per level ("ttir", "ptx", "sass"): True when old and new are the same after normalisation; "meta"
    likewise for the launch metadata; "notes": what was normalised away and the first differing lines."""
    res = {lvl: True for lvl in LEVELS} | {"meta": True, "notes": []}
    notes = res["notes"]
    if [n for n, _ in old_launches] != [n for n, _ in new_launches]:
        notes.append(f"launches differ: old {[n for n, _ in old_launches]} new {[n for n, _ in new_launches]}")
        return res | {lvl: False for lvl in (*LEVELS, "meta")}
    for (name, ko), (_, kn) in zip(old_launches, new_launches):
        lo, do = normalize_ptx(ko.asm["ptx"], ko, name)
        ln, dn = normalize_ptx(kn.asm["ptx"], kn, name)
        lo, drop_o, read_o = drop_unread(lo, do - dn)
        ln, drop_n, read_n = drop_unread(ln, dn - do)
        for side, dropped in (("old", drop_o), ("new", drop_n)):
            if dropped:
                notes.append(f"{side}-only params never read: {', '.join(d[5:] for d in dropped)}")
        if read_o or read_n:
            res["ptx"] = False
            notes.append(f"params on one side only and read: old {read_o} new {read_n}")
        if lo != ln:
            res["ptx"] = False
            head, *lines = _diff(lo, ln)
            notes += [f"{name} PTX: {head}", *lines]
            co, cn = (collections.Counter(x.split()[0] for x in v if not x.strip().startswith((".", "$", "{", "}")))
                      for v in (lo, ln))
            notes.append(f"{name} PTX instructions: " + (
                "the same counts of each (the same instructions in another order)" if co == cn else
                "counts differ: " + ", ".join(f"{k} {co[k]}->{cn[k]}" for k in sorted(set(co) | set(cn))
                                              if co[k] != cn[k])[:300]))
        # a Gluon kernel has no TTIR (its source lowers to TTGIR directly): its TTGIR stands in
        ir = "ttir" if "ttir" in ko.asm.keys() else "ttgir"
        to, tn = normalize_ttir(ko.asm[ir], name), normalize_ttir(kn.asm[ir], name)
        if to != tn:
            res["ttir"] = False
            notes.append(f"{name} TTIR: " + _diff(to, tn)[0])
        so, sn = normalize_sass(ko, name), normalize_sass(kn, name)
        if so is None:
            res["sass"] = False
            notes.append(f"{name} SASS: no cuobjdump")
        elif so != sn:
            res["sass"] = False
            head, *lines = _diff(so, sn, 6)
            notes += [f"{name} SASS: {head}", *lines]
        else:
            notes.append(f"{name} SASS: {len(sn)} instructions, same")
        mo = {k: getattr(ko.metadata, k, None) for k in META_KEYS}
        mn = {k: getattr(kn.metadata, k, None) for k in META_KEYS}
        if mo != mn:
            res["meta"] = False
            notes.append(f"{name} metadata: " + ", ".join(f"{k} {mo[k]} -> {mn[k]}" for k in META_KEYS
                                                             if mo[k] != mn[k]))
    return res


def ab_time(old_spec, new_spec, problem, dtype_key: str, config: dict, rounds: int) -> dict:
    """GPU: the entry's launch on the old and the new code, timed as tuning times a config (the store's
    timer and input rotation), in ``rounds`` alternating rounds (medians); and whether both give bitwise
    the same output on one input set."""
    import statistics

    from tritune.harness import bench

    dtype = store.torch_dtype(dtype_key)
    prec = torch.get_float32_matmul_precision()
    if dtype_key == "tfloat32":
        torch.set_float32_matmul_precision("high")
    try:
        mode = bench.timing_mode(new_spec, problem, dtype)
        cases = bench.timing_cases(new_spec, problem, dtype, "cuda", 0, mode)

        def calls(spec):
            return bench.cycling(cases, lambda c: lambda: spec.run(*c.args, out=c.out, config=dict(config),
                                                                   **c.kwargs))

        c0 = cases[0]
        outs = [spec.run(*c0.args, config=dict(config), **c0.kwargs) for spec in (old_spec, new_spec)]
        equal = bool(torch.equal(*outs))
        fns, times = {"old": calls(old_spec), "new": calls(new_spec)}, {"old": [], "new": []}
        for r in range(rounds):
            for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times[k].append(bench.time_ms(fns[k], mode) * 1e3)
    finally:
        torch.set_float32_matmul_precision(prec)
    old_us, new_us = statistics.median(times["old"]), statistics.median(times["new"])
    return {"old_us": round(old_us, 3), "new_us": round(new_us, 3), "ratio": round(new_us / old_us, 4),
            "mode": mode, "rounds": rounds, "outputs_equal": equal}


def restamp(path: Path, old_hash: str, new_hash: str, dest: Path) -> int:
    """Write ``path`` to ``dest`` with ``source`` old_hash -> new_hash in every entry and nothing else
    changed. Returns the count."""
    text = path.read_text()
    data = json.loads(text)
    if json.dumps(data, indent=1) + "\n" != text:
        raise SystemExit(f"{path}: not in the store writer's format (json indent=1); not rewritten")
    n = 0
    for e in data["entries"]:
        if e.get("source") == old_hash:
            e["source"] = new_hash
            n += 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, dest)  # a reader never sees half a file
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the commit the stored entries were tuned on")
    ap.add_argument("--old-file", help="the module's source at --old, where git history is not at hand")
    ap.add_argument("--module", default="tritune.kernels.attention", help="the kernel module")
    ap.add_argument("--kernels", nargs="*", help="spec names (default: every spec of the module)")
    ap.add_argument("--slugs", nargs="*", help="GPU slugs (default: every one in the packaged store)")
    ap.add_argument("--arch", type=int, default=90, help="sm version to compile for (90: H100/H200)")
    ap.add_argument("--level", choices=LEVELS, default="ptx",
                    help="what must be identical for --write: ptx (default: then any compiler makes the same "
                         "machine code of both), ttir, or sass (the machine code itself; accepted only from the "
                         "triton version a file was tuned with)")
    ap.add_argument("--write", action="store_true", help="restamp the files whose every entry is the same")
    ap.add_argument("--write-dir", help="with --write: write restamped files to DIR/<slug>/<kernel>.json "
                                        "instead of in place")
    ap.add_argument("--ab", choices=("different", "all"),
                    help="GPU: also time each entry's launch on the old and the new code (alternating rounds, "
                         "the tuner's timer) and check their outputs are bitwise equal; 'different': only the "
                         "entries not the same at --level. Evidence for a person: --write never acts on it")
    ap.add_argument("--rounds", type=int, default=5, help="--ab: alternating rounds per entry")
    ap.add_argument("--match", help="only entries whose '<dtype> <bucket>' matches this regular expression")
    ap.add_argument("--out", help="directory for a JSON of the results")
    a = ap.parse_args(argv)
    if a.ab and not torch.cuda.is_available():
        print("--ab: needs a GPU (torch.cuda.is_available() is False)")
        return 2

    new_mod = importlib.import_module(a.module)
    new_specs = {n: s for n, s in K.REGISTRY.items() if getattr(s.run, "__module__", None) == a.module}
    kernels = a.kernels or sorted(new_specs)
    unknown = [k for k in kernels if k not in new_specs]
    if unknown:
        print(f"--kernels: {unknown} are not specs of {a.module} ({sorted(new_specs)})")
        return 2
    if a.old_file:
        old_commit, src = a.old, Path(a.old_file).read_text()
    else:
        try:
            old_commit = subprocess.run(["git", "rev-parse", "--short", a.old], cwd=REPO, check=True,
                                        capture_output=True, text=True).stdout.strip()
            src = subprocess.run(["git", "show", f"{old_commit}:{module_path(a.module)}"], cwd=REPO, check=True,
                                 capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"--old: cannot read {module_path(a.module)} at {a.old!r} from git ({exc}); pass --old-file")
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="same_code_"))
    old_mod, old_specs = load_old_module(a.module, old_commit, src, tmp, from_git=not a.old_file)
    for m in (new_mod, old_mod):
        prime_device_queries(m, a.arch)
    old_hash, new_hash = store.module_hash(old_mod.__name__), store.source_hash(kernels[0])
    print(f"{a.module}: source hash at {old_commit} {old_hash}, now {new_hash}; triton {triton.__version__}, "
          f"sm{a.arch}; --write needs the same {a.level}")
    root = store.package_root()
    slugs = a.slugs or sorted(d.name for d in root.iterdir() if d.is_dir())
    results = []
    for slug in slugs:
        for kname in kernels:
            path = root / slug / f"{kname}.json"
            if not path.exists():
                continue
            data = json.loads(path.read_text())
            entries = store.validate(data, kname, slug)
            rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            print(f"== {rel}: {len(entries)} entries (tuned with triton {data.get('triton')})")
            file_ok = bool(entries)
            if a.level != "ttir" and data.get("triton") != triton.__version__:
                file_ok = False
                print(f"  (not restampable at --level {a.level}: this is triton {triton.__version__}, the entries were "
                      f"timed on {data.get('triton')}; the same {a.level} here says nothing about its output)")
            for e in entries:
                label = f"{e['dtype']:>8} {e['bucket']}"
                if a.match and not re.search(a.match, f"{e['dtype']} {e['bucket']}"):
                    file_ok = False  # not judged: the file is not proved whole
                    continue
                rec = {"file": str(rel), "bucket": e["bucket"], "dtype": e["dtype"], "config": e["config"],
                       "source": e.get("source")}
                results.append(rec)
                if e.get("source") != old_hash:
                    file_ok = False
                    rec["verdict"] = "not-old"
                    print(f"  SKIP      {label}: source {e.get('source')} is not {old_commit}'s {old_hash}")
                    continue
                t0, problem = time.time(), None
                try:
                    problem = entry_problem(new_specs[kname], e)
                    if problem is None:
                        raise ValueError("no problem known for this entry")
                    case = new_specs[kname].make_inputs(problem, store.torch_dtype(e["dtype"]), "cpu", 0)
                    old_l = compile_launches(old_specs[kname], e["dtype"], e["config"], case, a.arch)
                    new_l = compile_launches(new_specs[kname], e["dtype"], e["config"], case, a.arch)
                    res = compare(old_l, new_l)
                except Exception as exc:  # a config that no longer compiles or launches is a difference
                    res = {lvl: False for lvl in (*LEVELS, "meta")}
                    res["notes"] = [f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"]
                same = res[a.level] and res["meta"]
                file_ok &= same
                rec.update({lvl: res[lvl] for lvl in (*LEVELS, "meta")}, notes=res["notes"],
                           verdict="same" if same else "DIFFERENT", seconds=round(time.time() - t0, 1))
                levels = " ".join(f"{lvl}={'=' if res[lvl] else 'x'}" for lvl in (*LEVELS, "meta"))
                print(f"  {'same     ' if same else 'DIFFERENT'} {label} [{levels}] ({rec['seconds']} s)")
                for n in res["notes"]:
                    if not same or not n.startswith("    "):
                        print(f"      {n}")
                if a.ab == "all" or (a.ab == "different" and not same):
                    try:
                        rec["ab"] = ab_time(old_specs[kname], new_specs[kname], problem, e["dtype"], e["config"],
                                            a.rounds)
                        r = rec["ab"]
                        print(f"      A/B: old {r['old_us']} us, new {r['new_us']} us, new/old {r['ratio']} "
                              f"({r['mode']}, {r['rounds']} rounds); outputs "
                              f"{'bitwise equal' if r['outputs_equal'] else 'DIFFER'}; stored {e.get('time_us')} us")
                    except Exception as exc:
                        rec["ab"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                        print(f"      A/B: {rec['ab']['error']}")
                sys.stdout.flush()
            if not entries:
                print("  (no entries: nothing to restamp)")
            elif a.write and file_ok:
                dest = Path(a.write_dir) / slug / path.name if a.write_dir else path
                n = restamp(path, old_hash, new_hash, dest)
                print(f"  restamped {n} entries: source {old_hash} -> {new_hash} in {dest}")
            elif a.write:
                print(f"  NOT restamped: not every entry is {old_commit}'s and the same at --level {a.level}")
    judged = [r for r in results if r.get("verdict") != "not-old"]
    count = {lvl: sum(bool(r.get(lvl)) for r in judged) for lvl in (*LEVELS, "meta")}
    print(f"summary: {sum(r['verdict'] == 'same' for r in judged)} of {len(judged)} entries the same at "
          f"--level {a.level}; per level " + ", ".join(f"{k} {v}/{len(judged)}" for k, v in count.items())
          + f"; {len(results) - len(judged)} not {old_commit}'s")
    ab = [r["ab"] for r in judged if "ratio" in r.get("ab", {})]
    if ab:
        ratios = sorted(x["ratio"] for x in ab)
        print(f"A/B: {len(ab)} entries, new/old min {ratios[0]} median {ratios[len(ratios) // 2]} max {ratios[-1]}; "
              f"outputs bitwise equal in {sum(x['outputs_equal'] for x in ab)} of {len(ab)}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "same_code_restamp.json").write_text(json.dumps(
            {"module": a.module, "old": old_commit, "old_hash": old_hash, "new_hash": new_hash,
             "triton": triton.__version__, "arch": a.arch, "level": a.level, "entries": results}, indent=1) + "\n")
    return 0 if judged and all(r["verdict"] == "same" for r in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
