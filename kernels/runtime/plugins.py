"""Kernels from outside the package: entry points, ``--plugin MODULE`` and ``TRITUNE_PLUGINS``.

A plugin is a module that registers its kernels (``tritune.register(KernelSpec(...))``) when imported:

- an installed distribution names it in the entry-point group ``tritune.kernels``
  (``[project.entry-points."tritune.kernels"] my_rmsnorm = "my_package.rmsnorm"``);
- ad hoc, ``tritune --plugin my_module`` or ``TRITUNE_PLUGINS=my_module,other.py`` (a module name, or a
  path to a ``.py`` file; a module in the current directory is found as ``python -m`` would find it).

:func:`load` runs from ``kernels.all_specs()`` and ``kernels.get()``, so every process that looks a kernel up
(the CLI, pytest, tuning worker processes) has the plugins, and :func:`add` puts ``--plugin`` modules into
``TRITUNE_PLUGINS`` so spawned processes load the same ones before they unpickle a plugin's problem.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

GROUP = "tritune.kernels"
ENV = "TRITUNE_PLUGINS"

_loaded: dict[str, object] = {}   # plugin text (module name or path) -> module
_entry_points_done = False


class PluginError(ImportError):
    """A plugin named explicitly (``--plugin``, ``TRITUNE_PLUGINS``) could not be imported."""


def env_plugins() -> list[str]:
    return [p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip()]


def add(names) -> None:
    """Import ``names`` now, then export them in ``TRITUNE_PLUGINS`` for child processes (a name that fails
    to import raises :class:`PluginError` and is not exported). Entry-point plugins load with the registry."""
    have = env_plugins()
    for n in (n for n in names if n):
        key = str(Path(n).expanduser().resolve()) if _is_path(n) else n  # children may run elsewhere
        if key not in _loaded:
            _loaded[key] = _import(key)
        if key not in have:
            have.append(key)
    if have:
        os.environ[ENV] = ",".join(have)


_REGISTER = _SPEC = None


def load(register, spec_type) -> None:
    """Import the entry-point plugins (once; a broken one is a warning, not the end of tritune) and every
    module in ``TRITUNE_PLUGINS`` not imported yet (a broken one raises :class:`PluginError`). The registry
    passes its ``register`` and ``KernelSpec`` (an entry point may name specs rather than a module)."""
    global _entry_points_done, _REGISTER, _SPEC
    _REGISTER, _SPEC = register, spec_type
    if not _entry_points_done:
        _entry_points_done = True
        _load_entry_points()
    for name in env_plugins():
        if name not in _loaded:
            _loaded[name] = _import(name)


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=GROUP):
        try:
            obj = ep.load()
        except Exception as e:  # a broken installed package must not take the built-in kernels with it
            warnings.warn(f"tritune: the kernel plugin {ep.name!r} ({ep.value}) failed to load: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            continue
        _register_object(obj, ep.value)
        _loaded[ep.value] = obj


def _register_object(obj, where: str) -> None:
    """An entry point may name a module (which registered on import), a spec, or a list of specs. The
    registry hands its ``register`` to :func:`load`, so this module never imports ``tritune.kernels``
    (which imports it: no cycle)."""
    items = obj if isinstance(obj, (list, tuple)) else [obj]
    for item in items:
        if isinstance(item, _SPEC):
            _REGISTER(item)


def _is_path(name: str) -> bool:
    return name.endswith(".py") or os.sep in name or "/" in name


def _import(name: str):
    if _is_path(name):
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"plugin {name!r}: no such file")
        # importable by its stem from its folder: a worker process unpickles its problems by module name
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.append(folder)
        modname = path.stem
        if modname in sys.modules:
            return sys.modules[modname]
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            del sys.modules[modname]
            raise PluginError(f"plugin {name!r} failed to import: {type(e).__name__}: {e}") from e
        return mod
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        top = name.split(".")[0]
        if e.name == top and cwd not in sys.path and (
                Path(cwd, top + ".py").is_file() or Path(cwd, top, "__init__.py").is_file()):
            sys.path.append(cwd)  # as `python -m` would see it; spawned children inherit sys.path
            return _import(name)
        if e.name is not None and name.startswith(e.name):
            raise PluginError(f"plugin {name!r}: no module named {e.name!r} (not installed, not in the current "
                              f"directory)") from None
        raise PluginError(f"plugin {name!r} failed to import: {type(e).__name__}: {e}") from e
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"plugin {name!r} failed to import: {type(e).__name__}: {e}") from e
