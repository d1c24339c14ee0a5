"""Loaded at interpreter start in a lab server only (its PYTHONPATH names this directory).

The lab runs the stock ``mlx_lm.server`` console script, so the process looks exactly like a
user's server (mlxwatch recognises servers by their command line); this hook patches in the
switchable fault before the script imports the server. In a rank of an ``mlx.launch`` group
(``MLX_RANK`` set) the fault file is ``<MLXWATCH_FAULT_FILE>-rank<N>``: one rank's fault alone.
Stdlib only, like ``fault_server.py``.
"""

import os
import sys

_fault_file = os.environ.get("MLXWATCH_FAULT_FILE")
if _fault_file and os.environ.get("MLX_RANK"):  # a rank of an mlx.launch group: its own fault
    _fault_file = f"{_fault_file}-rank{os.environ['MLX_RANK']}"
if _fault_file:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import fault_server  # type: ignore[import-not-found]  # from the directory put on sys.path above

        fault_server.install(_fault_file)
    except Exception as exc:  # a lab without its fault is a broken lab: say so loudly
        print(f"mlxwatch lab: fault injection failed: {exc!r}", file=sys.stderr, flush=True)
        raise
    finally:
        sys.path.pop(0)
