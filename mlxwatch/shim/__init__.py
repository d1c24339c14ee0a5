"""The launch shim: evidence from inside an ``mlx_lm.server`` process, stdlib only.

``mlxwatch launch -- COMMAND`` execs the user's own server command with ``boot/`` first on
``PYTHONPATH``; ``boot/sitecustomize.py`` loads this package under the private name
``_mlxwatch_shim`` (by path: mlxwatch need not be installed in the server's venv) and starts
``agent``. Nothing here may import anything outside the standard library, in the server or in
mlxwatch: ``layout`` is shared by both sides, ``agent`` runs only in the server.

See ``agent`` for what the shim does and ``mlxwatch.shim.heartbeat`` for the reader.
"""
