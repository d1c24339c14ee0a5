"""The lab: real ``mlx_lm.server`` instances with switchable faults, for tests and the demo.

``tiny_model.py`` and ``fault_server.py`` run under the *server's* interpreter and import
nothing from mlxwatch; ``server.py`` launches them from mlxwatch's side.
"""
