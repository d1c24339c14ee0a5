"""macOS command lines against their documented synopses, and the uid rule for launchd targets.

No Mac runs these tools here, so each argv is checked against the grammar its manual documents,
written out below from the manual (not from mlxwatch's code):

- sample(1):   sample pid | partial-executable-name [duration [samplingInterval]] [-wait] [-mayDie]
               [-fullPaths] [-e] [-file filename]
- spindump(8): spindump [pid | partial-name [duration [interval]]] [<options>]; options from its
               usage text (macOS 26, quoted in blacktop/ipsw-diffs, MACHOS/spindump.md): -onlyTarget,
               -stdout, -noFile ("the report ... will go to stdout instead"), -noBinary, -o <path>,
               -timelimit <t>, -wait, -noProcessingWhileSampling, ...
- nettop(1) (mojave, https://www.unix.com/man-page/mojave/1/nettop): nettop [-ncd] [-m <mode>]
               [-t <type>] [-s <seconds>] [-p <process-name|pid>] [-n] [-l <samples>] [-L <samples>]
               [-P] [-j|k|J <column-name[,column-name]...>]; "-m <mode> ... tcp Only TCP sockets
               will be monitored", "-n Disable address to name resolution". -L's meaning (logging
               mode in CSV, that many samples, then exit) and the column names are from real
               output, not the manual's excerpt: tests/data/nettop-netglass-capture.csv
- launchctl(1): kickstart [-kp] service-target; service-target = domain-target/service-name,
               domain-target = system | user/<uid> | gui/<uid>
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mlxwatch.capture import macos, pyspy
from mlxwatch.config import RestartConfig
from mlxwatch.errors import RestartError
from mlxwatch.host import launchctl
from mlxwatch.restart.methods import launchd_command

SAMPLE_MAN = {"positional": ["pid", "duration", "samplingInterval"],
              "flags": {"-wait", "-mayDie", "-fullPaths", "-e"}, "with_value": {"-file"}}
NETTOP_MAN = {"positional": [], "flags": {"-n", "-c", "-d", "-P"},
              "with_value": {"-m", "-t", "-s", "-p", "-l", "-L", "-j", "-k", "-J"}}
SPINDUMP_MAN = {"positional": ["pid", "duration", "interval"],
                "flags": {"-onlyTarget", "-stdout", "-noFile", "-noBinary", "-noText", "-wait", "-heavy", "-timeline",
                          "-noProcessingWhileSampling", "-noThrottle"},
                "with_value": {"-o", "-i", "-timelimit", "-proc"}}


def parse_by_synopsis(argv: list[str], man: dict) -> tuple[dict[str, str], set[str], dict[str, str]]:
    """Split an argv by a manual's grammar; an option it does not document fails the test."""
    positional, flags, values = {}, set(), {}
    names = list(man["positional"])
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-") and not arg.lstrip("-").isdigit():
            assert arg in man["flags"] | man["with_value"], f"{arg} is not in the manual's synopsis"
            if arg in man["with_value"]:
                values[arg] = argv[i + 1]
                i += 2
                continue
            flags.add(arg)
        else:
            assert not flags and not values, f"positional {arg!r} after options"
            assert names, f"one positional too many: {arg!r}"
            positional[names.pop(0)] = arg
        i += 1
    return positional, flags, values


def test_sample_argv_follows_sample1(tmp_path):
    """-file (not -f, which sample(1) does not document) names the output; -mayDie keeps
    symbols if the server dies mid-sample; pid, duration and interval are positional, in order."""
    out = tmp_path / "native" / "sample.txt"
    argv = macos.sample_command(4242, out)
    assert Path(argv[0]).name == "sample"
    positional, flags, values = parse_by_synopsis(argv[1:], SAMPLE_MAN)
    assert positional["pid"] == "4242"
    assert int(positional["duration"]) >= 1 and int(positional["samplingInterval"]) >= 1
    assert "-mayDie" in flags
    assert values == {"-file": str(out)}


@pytest.mark.parametrize("sudo", [False, True])
def test_spindump_argv_follows_spindump8_and_writes_no_file(sudo):
    """Only the target is sampled; the report goes to stdout (no -o: under sudo that file would
    be root's); the sudo form is non-interactive and names spindump by absolute path."""
    argv = macos.spindump_command(4242, sudo=sudo)
    if sudo:
        assert argv[:2] == ["sudo", "-n"]
        argv = argv[2:]
    assert argv[0] == "/usr/sbin/spindump"
    positional, flags, values = parse_by_synopsis(argv[1:], SPINDUMP_MAN)
    assert positional["pid"] == "4242" and int(positional["duration"]) >= 1 and int(positional["interval"]) >= 1
    assert {"-onlyTarget", "-stdout", "-noFile"} <= flags
    assert "-o" not in values


def test_nettop_argv_follows_nettop1_and_asks_for_the_columns_of_the_real_output():
    """TCP only, numeric, one logging-mode sample, every process (no -p: the reader knows
    ports, not PIDs), per connection (no -P: a per-process summary has no connections), and
    exactly the columns of the real capture the parser is tested on (its header), so the
    output shape nettop gives this command is one that has been seen."""
    from mlxwatch.host import nettop

    argv = nettop.nettop_command()
    assert argv[0] == "/usr/bin/nettop"
    positional, flags, values = parse_by_synopsis(argv[1:], NETTOP_MAN)
    assert positional == {}
    assert values["-m"] == "tcp" and "-n" in flags
    assert values["-L"] == "1" and "-l" not in values
    assert not {"-P", "-d"} & flags and not {"-p", "-j", "-k"} & set(values)
    text = (Path(__file__).parent / "data" / "nettop-netglass-capture.csv").read_text()
    header = text.partition("# ----- output below, as quoted -----\n")[2].splitlines()[0]
    assert set(values["-J"].split(",")) == {name for name in header.split(",") if name}


def test_kickstart_argv_follows_launchctl1():
    argv = launchd_command(RestartConfig("launchd", "com.x.mlx"), uid=501)
    assert argv[:2] == ["launchctl", "kickstart"]
    options, target = argv[2:-1], argv[-1]
    assert set(options) <= {"-k", "-p"} and "-k" in options  # -k: kill the running instance, then restart
    assert re.fullmatch(r"(system|user/\d+|gui/\d+)/com\.x\.mlx", target)
    assert target == "gui/501/com.x.mlx"
    assert launchd_command(RestartConfig("launchd", "com.x.mlx", domain="system"), uid=501)[-1] == "system/com.x.mlx"
    assert launchd_command(RestartConfig("launchd", "com.x.mlx", domain="user"), uid=501)[-1] == "user/501/com.x.mlx"


@pytest.fixture
def as_root(monkeypatch):
    monkeypatch.setattr(launchctl, "effective_uid", lambda: 0)
    monkeypatch.setattr(launchctl, "real_uid", lambda: 0)


def test_root_daemon_takes_the_uid_from_config(as_root):
    """As root, os.getuid() would give gui/0/...: `Could not find service` (exit 113)."""
    assert launchd_command(RestartConfig("launchd", "com.x.mlx", uid=501))[-1] == "gui/501/com.x.mlx"


def test_root_daemon_takes_the_uid_from_the_server_process(as_root, monkeypatch):
    monkeypatch.setattr(launchctl, "process_owner", lambda pid: 502 if pid == 4242 else None)
    assert launchd_command(RestartConfig("launchd", "com.x.mlx"), server_pid=4242)[-1] == "gui/502/com.x.mlx"


def test_root_daemon_without_a_uid_fails_the_restart_with_what_to_set(as_root, monkeypatch):
    monkeypatch.setattr(launchctl, "process_owner", lambda pid: None)
    with pytest.raises(RestartError, match="set restart.uid"):
        launchd_command(RestartConfig("launchd", "com.x.mlx"))
    assert launchd_command(RestartConfig("launchd", "com.x.mlx", domain="system"))[-1] == "system/com.x.mlx"


def test_a_root_owned_server_does_not_make_gui_0(as_root, monkeypatch):
    monkeypatch.setattr(launchctl, "process_owner", lambda pid: 0)
    with pytest.raises(RestartError):
        launchd_command(RestartConfig("launchd", "com.x.mlx"), server_pid=1)


def test_not_root_uses_its_own_uid(monkeypatch):
    monkeypatch.setattr(launchctl, "effective_uid", lambda: 501)
    monkeypatch.setattr(launchctl, "real_uid", lambda: 501)
    monkeypatch.setattr(launchctl, "process_owner", lambda pid: None)
    assert launchd_command(RestartConfig("launchd", "com.x.mlx"))[-1] == "gui/501/com.x.mlx"


def test_process_owner_reads_a_real_process():
    assert launchctl.process_owner(os.getpid()) == os.getuid()
    assert launchctl.process_owner(None) is None


# py-spy's own failure texts (src/python_spy.rs, src/python_process_info.rs) as users quote them:
# benfred/py-spy#754 (macOS 14.6, Apple silicon), #726 (macOS 14.5, M2, py-spy 0.4.0).
PYSPY_754 = "Error: Failed to open process - check if it is running.\nReason: Operation timed out (os error 60)\n"
PYSPY_726 = "Error: Failed to find python version from target process\n"


def test_known_py_spy_failures_are_explained_and_not_retried():
    assert "#242" in pyspy.explain(PYSPY_754) and pyspy.hopeless(PYSPY_754)
    assert "#726" in pyspy.explain(PYSPY_726) and pyspy.hopeless(PYSPY_726)
    assert "0.4.2" in pyspy.explain("Error: Unsupported version of Python: 3.14.0\n")
    assert pyspy.explain("Error: Failed to suspend process\n") is None  # a SIGSTOPped target: --nonblocking helps
    assert not pyspy.hopeless("Error: No such process (os error 3)\n")


def test_py_spy_floor_reads_python_3_14():
    """3.14 support came in py-spy 0.4.2 (benfred/py-spy#833, tag v0.4.2 adds v3_14_0 bindings)."""
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    floor = re.search(r'"py-spy>=([0-9.]+)"', text).group(1)
    assert tuple(int(p) for p in floor.split(".")) >= (0, 4, 2)


# --- restart.uid in the config (tests/test_config.py's style: one exact line per bad input)

A = "name: a, url: 'http://127.0.0.1:1'"


def test_restart_uid_is_read_for_launchd(config_file):
    from mlxwatch.config import load_config

    cfg = load_config(config_file(f"instances: [{{{A}, restart: {{launchd: com.x, uid: 501}}}}]"))
    assert cfg.instances[0].restart == RestartConfig(method="launchd", target="com.x", uid=501)
    assert load_config(config_file(f"instances: [{{{A}, restart: {{launchd: com.x}}}}]")).instances[0].restart.uid is None


@pytest.mark.parametrize("text, message", [
    (f"instances: [{{{A}, restart: {{launchd: x, uid: -1}}}}]",
     "instances[0].restart.uid: must be a user id from 0 to 2147483647 (got -1)"),
    (f"instances: [{{{A}, restart: {{launchd: x, uid: '501'}}}}]",
     "instances[0].restart.uid: must be a user id, a whole number such as 501 (`id -u`) (got '501')"),
    (f"instances: [{{{A}, restart: {{launchd: x, uid: true}}}}]",
     "instances[0].restart.uid: must be a user id, a whole number such as 501 (`id -u`) "
     "(got true: YAML reads a bare on, off, yes or no as true or false)"),
    (f"instances: [{{{A}, restart: {{launchd: x, uid: 4294967296}}}}]",
     "instances[0].restart.uid: must be a user id from 0 to 2147483647 (got 4294967296)"),
    (f"instances: [{{{A}, restart: {{launchd: x, domain: system, uid: 501}}}}]",
     "instances[0].restart.uid: the system domain has no uid; drop uid or use domain gui or user (got 501)"),
    (f"instances: [{{{A}, restart: {{command: [x], uid: 501}}}}]",
     "instances[0].restart.uid: unknown key (got 501)"),
])
def test_bad_restart_uid_is_one_line_exit_2(config_file, capsys, text, message):
    from mlxwatch.cli import run

    path = config_file(text)
    assert run(["config", "validate", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"mlxwatch: {path}: {message}"


# --- the documented sudoers rule (docs/launchd.md) allows exactly the spindump argv mlxwatch runs


def _sudoers_spindump_entries() -> list[str]:
    readme = (Path(__file__).parent.parent / "docs" / "launchd.md").read_text()
    block = readme.split("Cmnd_Alias MLXWATCH_SPINDUMP = \\\n", 1)[1].split("\nyouruser ALL", 1)[0]
    return [line.strip().rstrip("\\").strip().rstrip(",") for line in block.splitlines()]


def _sudoers_match(entry: str, argv: list[str]) -> bool:
    """sudoers(5): the command path must be equal and the arguments match as a glob (fnmatch);
    `[0-9]` is one digit and `*` would match spaces too."""
    import fnmatch

    path, _, args = entry.partition(" ")
    return argv[0] == path and fnmatch.fnmatchcase(" ".join(argv[1:]), args)


@pytest.mark.parametrize("pid", [1, 42, 4242, 99999])
def test_readme_sudoers_rule_allows_the_spindump_mlxwatch_runs(pid):
    argv = macos.spindump_command(pid, sudo=True)
    assert argv[:2] == ["sudo", "-n"]
    assert sum(_sudoers_match(e, argv[2:]) for e in _sudoers_spindump_entries()) == 1


@pytest.mark.parametrize("argv", [
    ["/usr/sbin/spindump", "1", "-o", "/etc/sudoers", "5", "10", "-onlyTarget", "-stdout", "-noFile", "-noBinary"],
    ["/usr/sbin/spindump", "1", "-i", "/etc/master.passwd", "-stdout"],
    ["/usr/sbin/spindump", "123456", "5", "10", "-onlyTarget", "-stdout", "-noFile", "-noBinary"],
    ["/usr/local/bin/spindump", "1", "5", "10", "-onlyTarget", "-stdout", "-noFile", "-noBinary"],
])
def test_readme_sudoers_rule_allows_nothing_else(argv):
    assert not any(_sudoers_match(e, argv) for e in _sudoers_spindump_entries())


# --- the three ways a server is started: recognised, and its versions read


@pytest.mark.parametrize("cmdline", [
    ["/v/bin/python3.12", "/v/bin/mlx_lm.server", "--port", "8082"],  # console script
    ["/v/bin/python3.12", "/v/bin/mlx_lm", "server", "--port", "8082"],  # the subcommand
    ["/v/bin/python3.12", "-m", "mlx_lm", "server", "--port", "8082"],
    ["/v/bin/python3.12", "-m", "mlx_lm.server", "--port", "8082"],  # deprecated by mlx-lm itself
])
def test_every_way_to_start_a_server_is_a_server_with_its_versions(cmdline, tmp_path):
    from mlxwatch.capture.versions import server_versions
    from mlxwatch.host.process import is_mlx_server, server_port

    assert is_mlx_server(cmdline) and server_port(cmdline) == 8082
    venv = tmp_path / "v"
    site = venv / "lib" / "python3.12" / "site-packages"
    (site / "mlx_lm-0.32.2.dist-info").mkdir(parents=True)
    (site / "mlx-0.32.4.dist-info").mkdir()
    (venv / "bin").mkdir()
    (venv / "bin" / "python3.12").write_text("")
    cmdline = [a.replace("/v/", f"{venv}/") for a in cmdline]
    assert server_versions(cmdline, None)["packages"] == {"mlx-lm": "0.32.2", "mlx": "0.32.4"}
