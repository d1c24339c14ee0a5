"""Loaded at interpreter start in a server started by ``mlxwatch launch`` (its PYTHONPATH names
this directory first). Stdlib only; it imports nothing from mlxwatch's dependencies.

1. Note the time (the heartbeat's ``started_at``, checked against the process's create time).
2. Give the server's environment back to it: this directory leaves ``PYTHONPATH`` and the
   shim's variables leave ``os.environ``, so Python processes the server starts do not load
   the shim too.
3. Run the ``sitecustomize`` this one hides (the venv's, the system's, the lab's), first, so
   that whatever it patches in is inside the shim's counting wrapper.
4. Load the shim package by path under the private name ``_mlxwatch_shim`` (mlxwatch need not
   be installed in the server's venv) and start its agent.

Nothing here may stop the server: every failure is one line on stderr.
"""

import os
import sys
import time

_started_at = time.time()
_here = os.path.dirname(os.path.abspath(__file__))


def _same_dir(entry: str) -> bool:
    try:
        return os.path.abspath(entry or ".") == _here
    except Exception:
        return False


def _restore_environment() -> dict:
    """The shim's settings, taken out of os.environ; PYTHONPATH without this directory."""
    settings = {}
    for key in ("MLXWATCH_SHIM", "MLXWATCH_SHIM_NAME", "MLXWATCH_SHIM_EXIT_ON_THREAD_DEATH", "MLXWATCH_SHIM_BOOT",
                "MLXWATCH_SHIM_RECORD"):
        if key in os.environ:
            settings[key] = os.environ.pop(key)
    if "MLXWATCH_RUNTIME_DIR" in os.environ:  # kept: the server's children may want it; read, not popped
        settings["MLXWATCH_RUNTIME_DIR"] = os.environ["MLXWATCH_RUNTIME_DIR"]
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    rest = [e for e in entries if not _same_dir(e)]
    if rest and any(rest):
        os.environ["PYTHONPATH"] = os.pathsep.join(rest)
    else:
        os.environ.pop("PYTHONPATH", None)
    return settings


def _chain() -> None:
    """Import the next ``sitecustomize`` on sys.path, as site.py would have without us."""
    me = sys.modules.pop("sitecustomize", None)
    positions = [i for i, e in enumerate(sys.path) if _same_dir(e)]
    for i in reversed(positions):
        del sys.path[i]
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401  (the next one, if any)
    except ImportError as exc:
        if getattr(exc, "name", None) != "sitecustomize":
            sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")
    except Exception as exc:
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")
    finally:
        chained = sys.modules.get("sitecustomize")
        if chained is not None and chained is not me:
            sys.modules["_mlxwatch_chained_sitecustomize"] = chained
        if me is not None:
            sys.modules["sitecustomize"] = me
        for i in positions:
            sys.path.insert(min(i, len(sys.path)), _here)


def _start(settings: dict) -> None:
    import importlib.util

    package_dir = os.path.dirname(_here)
    spec = importlib.util.spec_from_file_location(
        "_mlxwatch_shim", os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the shim package from {package_dir}")
    package = importlib.util.module_from_spec(spec)
    sys.modules["_mlxwatch_shim"] = package
    spec.loader.exec_module(package)
    from _mlxwatch_shim import agent  # type: ignore[import-not-found]  # the package just loaded

    agent.start(_started_at, env=settings)


def _boot() -> None:
    try:
        settings = _restore_environment()
    except Exception as exc:
        sys.stderr.write(f"mlxwatch shim: not started: {type(exc).__name__}: {exc}\n")
        return
    _chain()
    if settings.get("MLXWATCH_SHIM") != "1":
        return  # on PYTHONPATH by accident (not through `mlxwatch launch`): do nothing
    try:
        _start(settings)
    except Exception as exc:
        sys.stderr.write(f"mlxwatch shim: not started: {type(exc).__name__}: {exc}\n")


_boot()
