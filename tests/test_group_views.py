"""A group as people and monitors see it: ``status`` (and ``--json``), ``mlxwatch_rank_up``,
``config init`` and ``doctor``, from the state file's ``group`` (``Group.to_dict()``, written by
the daemon) or from a group found now. No real server: the group here is data, or fakes at the
discovery seam; real groups are in tests/test_group_real.py and tests/test_group_remote.py."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from mlxwatch import cli
from mlxwatch.config import CaptureConfig, Config, InstanceConfig
from mlxwatch.daemon.metrics import Metrics
from mlxwatch.daemon.status import collect_status
from mlxwatch.host.discover import find_servers, starter_config
from mlxwatch.host.group import Group, Rank
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.journal.state import StateFile
from mlxwatch.output.config import render_written
from mlxwatch.output.status import status_lines

GROUP = {"launcher": {"pid": 4100, "create_time": 1.0, "cmdline": ["/v/bin/mlx.launch", "--hosts", "x"]},
         "backend": "ring", "hosts": ["127.0.0.1", "mac-studio-2.local"], "hostfile": None,
         "ranks": [{"rank": 0, "host": "127.0.0.1", "pid": 4101, "start": "12.50", "state": "running"},
                   {"rank": 1, "host": "mac-studio-2.local", "pid": 811, "start": "3.10", "state": "stopped"}],
         "errors": []}


def _state_dir(tmp_path, instances: dict) -> str:
    (tmp_path / "state.json").write_text(json.dumps({"instances": instances, "daemon": {}}))
    return str(tmp_path)


def _status_json(state_dir: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.run(["status", "--state-dir", state_dir, "--json"], out=Console(file=io.StringIO()))
    return json.loads(out.getvalue())


def test_status_json_shows_each_rank_of_a_group(tmp_path):
    """The state file's ``group`` under an instance: ``status --json`` gives the launcher, the
    backend and each rank's number, host, PID and state; a single server's ``group`` is null."""
    where = _state_dir(tmp_path, {"big": {"state": "hung", "group": GROUP}, "one": {"state": "healthy"}})
    by_name = {i["name"]: i for i in _status_json(where)["instances"]}
    group = by_name["big"]["group"]
    assert (group["launcher_pid"], group["backend"], group["size"]) == (4100, "ring", 2)
    assert group["ranks"] == [{"rank": 0, "host": "127.0.0.1", "pid": 4101, "state": "running"},
                              {"rank": 1, "host": "mac-studio-2.local", "pid": 811, "state": "stopped"}]
    assert by_name["one"]["group"] is None


def test_status_shows_one_line_per_rank_within_80_columns(tmp_path):
    """One line for the group, one per rank (rank, host, PID, state); a host that could not be
    asked is named; every line fits 80 columns. A single server's lines are unchanged."""
    unreachable = {**GROUP, "hosts": [*GROUP["hosts"], "mac-3"],
                   "ranks": [*GROUP["ranks"], {"rank": 2, "host": "mac-3", "pid": None, "start": "",
                                                "state": "unknown"}],
                   "errors": ["mac-3: ssh exit 255: ssh: connect to host mac-3 port 22: Connection refused "
                              "after a long wait that goes on and on"]}
    _state_dir(tmp_path, {"big": {"state": "healthy", "group": unreachable}, "one": {"state": "healthy"}})
    config = Config(None, (InstanceConfig("big", "http://127.0.0.1:8080"),
                           InstanceConfig("one", "http://127.0.0.1:8081")), None, (), CaptureConfig())
    lines = [t.plain for t in status_lines(collect_status(config, tmp_path), 80)]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert "  mlx.launch group of 3 ranks (ring), launcher PID 4100" in lines
    assert "    rank 0  127.0.0.1  PID 4101  running" in lines
    assert "    rank 1  mac-studio-2.local  PID 811  stopped" in lines
    assert "    rank 2  mac-3  no PID  unknown" in lines
    assert any(line.startswith("    not asked: mac-3: ssh exit 255") for line in lines)
    one = lines.index(next(line for line in lines if line.startswith("one ")))
    assert not any("rank" in line for line in lines[one:])  # a single server: nothing new


@pytest.mark.parametrize("group", [5, "x", [], {"ranks": 5}, {"ranks": [5, {"rank": "one"}]},
                                   {"ranks": [{"rank": True}]}, {"launcher": 3, "ranks": [{"rank": 0, "pid": "x"}]}])
def test_a_damaged_group_entry_is_shown_as_far_as_it_makes_sense(group, tmp_path, capsys):
    """The state file is untrusted input: a hand-edited ``group`` never gives a traceback."""
    where = _state_dir(tmp_path, {"big": {"state": "healthy", "group": group}})
    for extra in ([], ["--json"]):
        code = cli.run(["status", "--state-dir", where, *extra], out=Console(file=io.StringIO()))
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err and "internal error" not in err, err


def _rank_up(state: StateFile, names: tuple[str, ...] = ("big", "one")) -> dict[tuple[str, str, str], float]:
    config = Config(None, tuple(InstanceConfig(n, f"http://127.0.0.1:{8080 + i}") for i, n in enumerate(names)),
                    None, (), CaptureConfig())
    text = Metrics(lambda: config, state).exposition().decode()
    return {(s.labels["server"], s.labels["rank"], s.labels["host"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == "mlxwatch_rank_up"}


def test_rank_up_per_rank_from_the_state_files_group(tmp_path):
    """``mlxwatch_rank_up{server,rank,host}``: 1 for a running rank, 0 for a stopped, gone or
    unreachable one; no sample for a single server, nor for a damaged group entry."""
    _state_dir(tmp_path, {"big": {"state": "hung", "group": {
        **GROUP, "ranks": [*GROUP["ranks"], {"rank": 2, "host": "mac-3", "pid": None, "state": "unknown"}]}},
        "one": {"state": "healthy"}})
    state = StateFile(tmp_path)
    assert _rank_up(state) == {("big", "0", "127.0.0.1"): 1.0, ("big", "1", "mac-studio-2.local"): 0.0,
                               ("big", "2", "mac-3"): 0.0}
    state.update("big", group={"ranks": [{"rank": "zero"}, 7]})
    assert _rank_up(state) == {}



class _Proc:
    """What ``find_servers`` reads of a process (``process_iter``'s ``info``); no such PID runs."""

    def __init__(self, pid: int, port: int) -> None:
        self.info = {"pid": pid, "status": "sleeping", "ppid": 1,
                     "cmdline": ["/v/bin/python", "/v/bin/mlx_lm.server", "--model", "/m/big-model", "--port",
                                 str(port)]}


def _local_group(rank0: int, rank1: int) -> Group:
    launcher = ProcessIdentity(rank0 - 1, 1.0, ("/v/bin/python", "/v/bin/mlx.launch", "-n", "2"))
    return Group(launcher, "ring", ("127.0.0.1", "127.0.0.1"), None, "hostfile:x",
                 (Rank(0, "127.0.0.1", rank0, "1.00", "running"), Rank(1, "127.0.0.1", rank1, "1.00", "running")))


def test_config_init_names_rank0_as_one_instance_of_a_group(tmp_path):
    """``config init``'s discovery: rank 0 of a group is one instance that says it is a group
    of N ranks (in the written config and on screen); another rank of it is not an instance."""
    rank0, rank1, single = 2_000_000_001, 2_000_000_002, 2_000_000_003  # above any real PID
    group = _local_group(rank0, rank1)
    servers = find_servers([_Proc(rank0, 8080), _Proc(rank1, 8090), _Proc(single, 8081)], launchd_jobs=dict,
                           groups=lambda pid: group if pid in (rank0, rank1) else None)
    assert [(s.pid, s.url) for s in servers] == [(rank0, "http://127.0.0.1:8080"), (single, "http://127.0.0.1:8081")]
    assert servers[0].group is group and servers[1].group is None
    text = starter_config(servers)
    assert "# rank 0 of an mlx.launch group of 2 ranks (ring): 127.0.0.1;" in text
    assert text.count("mlx.launch group") == 1
    console = Console(file=io.StringIO(), width=80)
    render_written(tmp_path / "c.yaml", False, servers, console)
    lines = console.file.getvalue().splitlines()
    assert "    rank 0 of an mlx.launch group of 2 ranks (ring): 127.0.0.1" in lines
    assert all(len(line) <= 80 for line in lines if "group" in line)
    # found by a new user: each server's line (107 columns) and the next commands (112) ran on
    # (the CLI's console, piped: soft wrap, the text kept whole unless reflowed)
    console = Console(file=io.StringIO(), width=80, soft_wrap=True)
    render_written(tmp_path / "a-longer-directory-name" / "config-for-this-machine.yaml", True, servers, console,
                   config_option=" --config /tmp/a-longer-directory-name/config-for-this-machine.yaml")
    assert all(len(line) <= 80 for line in console.file.getvalue().splitlines() if " " in line.strip())
