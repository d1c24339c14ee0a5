"""The daemon's own log rotation under fd exhaustion: a rotation that cannot open the new file
never moves the log away from the path the daemon was started with, never renames again on
every line (``daemon.log.1.1.1…``), says once that the cap is not applied, and tries again later."""

from __future__ import annotations

import errno
import logging
import os

from mlxwatch.daemon.selflog import RotatingStderr, fd_path


def test_rotation_that_cannot_open_the_new_file_keeps_the_path_and_retries_later(tmp_path, monkeypatch):
    """EMFILE at the new file's open (measured: the log was renamed to ``.1`` first, then ``.1.1``
    at every line until the name reached 255 characters; one 65 MB file, the configured path gone)."""
    path = tmp_path / "daemon.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    real_open = os.open
    refused: list[str] = []

    def out_of_fds(file, flags, mode=0o777, **kwargs):
        if os.fspath(file).startswith(os.fspath(path)):
            refused.append(os.fspath(file))
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(file, flags, mode, **kwargs)

    logger = logging.getLogger("mlxwatch.test-selflog-rotation")
    logger.propagate = False
    handler = RotatingStderr(max_bytes=1000, keep=2, fd=fd)
    logger.addHandler(handler)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(os, "open", out_of_fds)
            for i in range(60):  # ~3 KB: three size thresholds' worth while no fd can be opened
                logger.warning("starved %03d %s", i, "x" * 40)
        assert refused, "the rotation never tried to open a new file"
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["daemon.log"], names  # nothing renamed: no .1, no .1.1
        assert fd_path(fd) == path  # the daemon still writes to the configured path
        assert len(refused) == 1  # one try, not one per line
        assert handler.rotations == 0
        text = path.read_text()
        assert "starved 059" in text
        assert text.count("log not rotated") == 1 and "Too many open files" in text

        handler.retry_seconds = 0  # the pause is over and descriptors are free again
        for i in range(5):
            logger.warning("after %03d %s", i, "y" * 40)
    finally:
        logger.removeHandler(handler)
        handler.flush()
        os.close(fd)
    assert handler.rotations == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.log", "daemon.log.1"]
    assert "starved 059" in (tmp_path / "daemon.log.1").read_text()
    current = path.read_text()
    assert "after 004" in current and path.stat().st_size <= 1000
