"""The daemon's own log (kept by launchd, attached to bug reports) never holds a secret from the
server's command line: the command-line rule of the redaction runs on every line it writes."""

from __future__ import annotations

import logging
import os

from mlxwatch.daemon.selflog import RotatingStderr
from mlxwatch.host.process import ProcessIdentity

KEY = "sk-ant-api03-Pl4ntedDaemonLogKey0123"
CMDLINE = ("/usr/bin/python3", "-m", "mlx_lm.server", "--api-key", KEY, "--port", "8080")


def test_daemon_log_redacts_the_servers_command_line(tmp_path):
    """'server is PID N: …' with ``--api-key sk-ant-…`` (and ``--token=…``) in the server's
    command line: the log line names the process and its flags, never the key."""
    path = tmp_path / "mlxwatch.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    logger = logging.getLogger("mlxwatch.test-selflog-redaction")
    try:
        handler = RotatingStderr(fd=fd)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
        try:
            logger.info("%s: server is %s", "main", ProcessIdentity(42, 1.0, CMDLINE).describe())
            logger.warning("looked again: %s", "mlx_lm.server --token=Pl4ntedEqualsToken --max-tokens 4")
        finally:
            logger.removeHandler(handler)
            handler.flush()
    finally:
        os.close(fd)
    text = path.read_text()
    assert KEY not in text and "Pl4ntedEqualsToken" not in text
    assert "main: server is PID 42: python3 -m mlx_lm.server --api-key [redacted]" in text
    assert "--max-tokens 4" in text and "--token=[redacted]" in text
