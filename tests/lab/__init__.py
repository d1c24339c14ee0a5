"""The test lab: what only tests and benchmarks use, never shipped in the wheel.

``server.py`` extends the demo's lab server (``mlxwatch._lab``: tiny model, fault injector)
with extra server arguments, a start through ``mlxwatch launch`` and a slow load; ``standin.py``
is a token-streaming stand-in with no model; ``clients.py`` loads a server like users do;
``ports.py`` finds free loopback ports; ``cli.py`` starts and relaunches lab servers from a shell
or a watchdog restart hook; ``group.py`` runs real ``mlx.launch`` groups, ``fakegroup.py`` a
stand-in group with no model, both under ``keepalive.py`` (a supervisor as launchd's
KeepAlive). Tests import it as ``lab`` (pytest puts ``tests/`` on sys.path); benchmarks put
``tests/`` on sys.path themselves (bench/common.py).
"""
