"""mlxwatch: a watchdog and hang diagnostics for ``mlx_lm.server``.

It judges a server by the tokens it delivers to a short streaming probe, captures evidence
(py-spy stacks, process stats, log markers) while a hung server is still hung, classifies the
failure, then restarts the server and keeps a journal. See README.md.
"""

__version__ = "0.1.0"
