"""The demo's lab (private): a real ``mlx_lm.server`` on a tiny model with a switchable fault.

Only ``mlxwatch demo`` uses it: ``server.py`` makes the tiny model and starts the stock server
with the fault injector; ``relaunch.py`` is the demo's restart hook. ``tiny_model.py``,
``fault_server.py`` and ``inject/sitecustomize.py`` run under the *server's* interpreter and
import nothing from mlxwatch. The test suite's lab (``tests/lab``, not shipped) builds on it.
"""
