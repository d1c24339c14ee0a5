"""An ``mlx.launch`` group's files, read by the daemon from paths another process names (its
``--hostfile``, its ``MLX_HOSTFILE``, its command's first word): a FIFO there blocked the
reader for ever (the daemon, ``check``, ``status``'s lookup), a file not in UTF-8 raised out of
``group_key`` (a traceback). Found by trying them; now read bounded, regular files only."""

from __future__ import annotations

import json
import os

import pytest

from mlxwatch.host.group import _interpreter, group_key, parse_launcher


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "hosts.json"
    os.mkfifo(path)
    return path


@pytest.mark.timeout(10)
def test_a_fifo_as_the_hostfile_is_no_group_key_and_no_hosts(fifo):
    assert group_key({"MLX_HOSTFILE": str(fifo)}) is None
    assert parse_launcher(["mlx.launch", "--hostfile", str(fifo), "mlx_lm.server"]).hosts == []


@pytest.mark.timeout(10)
def test_a_fifo_as_the_command_is_not_read_for_its_interpreter(fifo):
    assert _interpreter([str(fifo), "--model", "m"], None) == "python3"


def test_a_hostfile_not_in_utf8_is_no_group_key(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_bytes(b'[{"ssh": "h\xff"}]')
    assert group_key({"MLX_HOSTFILE": str(path)}) is None
    assert parse_launcher(["mlx.launch", "--hostfile", str(path), "mlx_lm.server"]).hosts == []


def test_a_real_hostfile_still_reads(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]))
    assert group_key({"MLX_HOSTFILE": str(path)}) == "hostfile:" + path.read_text().strip()
    assert parse_launcher(["mlx.launch", "--hostfile", str(path), "mlx_lm.server"]).hosts == ["a", "b"]


@pytest.mark.timeout(10)
def test_the_remote_listing_keys_a_group_by_the_same_rule(tmp_path, fifo):
    """``REMOTE_SCRIPT``'s ``key_of`` (run on a rank's host over ssh) and ``group_key`` must agree,
    or a remote rank is not found: the FIFO and the file not in UTF-8 are no key on either side."""
    from mlxwatch.host.group import REMOTE_SCRIPT

    source = REMOTE_SCRIPT.split("if sys.argv[1] == \"list\":")[0]
    scope: dict = {}
    exec(compile(source, "REMOTE_SCRIPT", "exec"), scope)
    bad = tmp_path / "latin.json"
    bad.write_bytes(b'[{"ssh": "h\xff"}]')
    good = tmp_path / "good.json"
    good.write_text('[{"ssh": "a"}]\n')
    for path in (fifo, bad, good):
        env = {"MLX_HOSTFILE": str(path)}
        assert scope["key_of"](env) == group_key(env)
    assert group_key({"MLX_HOSTFILE": str(good)}) == 'hostfile:[{"ssh": "a"}]'
