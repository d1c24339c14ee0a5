"""The launchd agent: what `mlxwatch launchd plist` prints, that the hand-edit template is the
same agent, and `launchd install` / `uninstall` through the one launchctl seam
(`mlxwatch.host.launchctl.runner`, replaced here: there is no launchd on Linux).

The launchctl command lines are checked against launchctl(1)'s synopsis, written out below
from the man page rather than from the code:

    bootstrap | bootout domain-target [service-path ...] | service-target
    print domain-target | service-target
    domain-target: system | user/<uid> | gui/<uid>;  service-target: <domain-target>/<service-name>
"""

from __future__ import annotations

import plistlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxwatch.cli import run
from mlxwatch.daemon.agent import agent
from mlxwatch.host import launchctl

TEMPLATE = Path(__file__).parent.parent / "launchd" / "com.mlxwatch.daemon.plist"
SERVER_TEMPLATE = Path(__file__).parent.parent / "launchd" / "com.example.mlx-server.plist"
DATA = Path(__file__).parent / "data"

# launchctl(1), SUBCOMMANDS: the shapes a command line must have (not the code's strings).
DOMAIN_TARGET = r"(system|user/\d+|gui/\d+)"
SYNOPSIS = {
    "bootstrap": re.compile(rf"^launchctl bootstrap {DOMAIN_TARGET} /\S+\.plist$"),
    "bootout": re.compile(rf"^launchctl bootout {DOMAIN_TARGET}/[\w.-]+$"),
    "print": re.compile(rf"^launchctl print {DOMAIN_TARGET}/[\w.-]+$"),
}
# launchd.plist(5): the keys of an agent, and the ProcessType values it documents.
PLIST_KEYS = {"Label", "ProgramArguments", "EnvironmentVariables", "RunAtLoad", "KeepAlive", "ThrottleInterval",
              "ProcessType", "StandardOutPath", "StandardErrorPath"}
UNTHROTTLED = "Interactive"  # "the same resource limitations as apps, that is to say, none"


def recorded(name: str) -> str:
    """A fixture's recorded output (below its source header)."""
    return (DATA / name).read_text().split("# ----- output below, as quoted -----\n", 1)[1]


GOOD_CONFIG = "instances: [{name: local, url: 'http://127.0.0.1:8082', restart: {launchd: com.example.mlx-server}}]\n"


class FakeLaunchd:
    """launchctl as the seam sees it: what was run, and a gui/501 domain that knows some labels."""

    def __init__(self, loaded: dict[str, str] | None = None, fail: dict[str, launchctl.Result] | None = None):
        self.calls: list[list[str]] = []
        self.loaded = dict(loaded or {})  # label -> `launchctl print` output
        self.fail = fail or {}

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        verb, target = argv[1], argv[-1]
        if verb in self.fail:
            return self.fail[verb]
        label = target.rsplit("/", 1)[-1]
        if verb == "print":
            if label in self.loaded:
                return launchctl.Result(0, self.loaded[label], "")
            # NixOS/nix#9978: `launchctl print` of an unknown service prints "Bad request." first
            return launchctl.Result(113, "", f'Bad request.\nCould not find service "{label}" in domain for user gui: 501\n')
        if verb == "bootout":
            self.loaded.pop(label, None)
            return launchctl.Result(0, "", "")
        if verb == "bootstrap":
            plist = plistlib.loads(Path(target).read_bytes())
            self.loaded[plist["Label"]] = f"gui/501/{plist['Label']} = {{\n\tpath = {target}\n\tstate = running\n}}\n"
            return launchctl.Result(0, "", "")
        return launchctl.Result(1, "", f"unexpected {argv}")

    def lines(self) -> list[str]:
        return [" ".join(c) for c in self.calls]


@pytest.fixture
def mac(monkeypatch, tmp_path):
    """A logged-in user 501 with a launchctl, HOME in tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    fake = FakeLaunchd()
    monkeypatch.setattr(launchctl, "runner", fake)
    monkeypatch.setattr(launchctl, "available", lambda: True)
    monkeypatch.setattr(launchctl, "effective_uid", lambda: 501)
    monkeypatch.setattr(launchctl, "real_uid", lambda: 501)
    return home, fake


def test_rendered_agent_runs_this_mlxwatch_with_the_config(tmp_path):
    """Round trip through plistlib: exactly the documented keys, absolute paths, unthrottled."""
    config = tmp_path / "config.yaml"
    config.write_text(GOOD_CONFIG)  # a config the agent can run (plist refuses others, as install does)
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), "launchd", "plist"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plist = plistlib.loads(proc.stdout)
    assert set(plist) == PLIST_KEYS
    bin_dir = str(Path(sys.executable).parent.absolute())
    assert plist["ProgramArguments"] == [f"{bin_dir}/mlxwatch", "--config", str(config.resolve()), "run"]
    assert all(Path(p).is_absolute() for p in (plist["ProgramArguments"][0], plist["ProgramArguments"][2],
                                                plist["StandardOutPath"], plist["StandardErrorPath"]))
    assert plist["EnvironmentVariables"]["PATH"].split(":")[0] == bin_dir
    assert {"/usr/bin", "/usr/sbin"} <= set(plist["EnvironmentVariables"]["PATH"].split(":"))  # sample, spindump
    assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True and plist["ThrottleInterval"] > 0
    assert plist["ProcessType"] == UNTHROTTLED
    assert Path(plist["StandardErrorPath"]).parent.parts[-3:] == ("Library", "Logs", "mlxwatch")


def test_plist_subcommand_takes_its_own_config_and_label(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(GOOD_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(tmp_path / "c.yaml"), "launchd", "plist",
                           "--label", "org.me.watch", "--config", str(other)], capture_output=True, timeout=60)
    plist = plistlib.loads(proc.stdout)
    assert plist["Label"] == "org.me.watch"
    assert plist["ProgramArguments"][2] == str(other.resolve())
    assert plist["StandardErrorPath"].endswith("/org.me.watch.log")


def test_template_matches_the_rendered_agent():
    """Fill the template's placeholders the way a person would: the same keys and values."""
    text = TEMPLATE.read_text().replace("@BIN@", "/venv/bin").replace("@CONFIG@", "/c.yaml").replace("@HOME@", "/Users/me")
    template = plistlib.loads(text.encode())
    rendered = agent(Path("/c.yaml"), bin_dir=Path("/venv/bin"),
                     log=Path("/Users/me/Library/Logs/mlxwatch/com.mlxwatch.daemon.log"))
    assert template == rendered


def test_server_example_is_unthrottled_and_logs_both_streams_to_one_file():
    """The example server agent: the `mlx_lm server` subcommand, Interactive, one log file."""
    plist = plistlib.loads(SERVER_TEMPLATE.read_bytes())
    assert plist["ProgramArguments"][:2] == ["@SERVER_BIN@/mlx_lm", "server"]
    assert plist["ProcessType"] == UNTHROTTLED
    assert plist["StandardOutPath"] == plist["StandardErrorPath"]


def test_install_writes_the_agent_and_bootstraps_it(mac, config_file, capsys):
    home, fake = mac
    config = config_file(GOOD_CONFIG)
    assert run(["launchd", "install", "--config", str(config)]) == 0
    path = home / "Library/LaunchAgents/com.mlxwatch.daemon.plist"
    plist = plistlib.loads(path.read_bytes())
    assert set(plist) == PLIST_KEYS and plist["ProgramArguments"][2] == str(config.resolve())
    assert path.stat().st_mode & 0o777 == 0o644
    assert (home / "Library/Logs/mlxwatch").is_dir()
    assert fake.lines() == ["launchctl print gui/501/com.mlxwatch.daemon", f"launchctl bootstrap gui/501 {path}"]
    assert SYNOPSIS["print"].match(fake.lines()[0]) and SYNOPSIS["bootstrap"].match(fake.lines()[1])
    out = capsys.readouterr().out
    assert "launchctl kill SIGHUP gui/501/com.mlxwatch.daemon" in out  # the lines name the label it chose


def test_install_boots_out_a_loaded_agent_first_and_uses_the_chosen_label(mac, config_file, capsys):
    home, fake = mac
    config = config_file(GOOD_CONFIG)
    assert run(["launchd", "install", "--config", str(config), "--label", "org.me.watch"]) == 0
    fake.calls.clear()
    assert run(["launchd", "install", "--config", str(config), "--label", "org.me.watch"]) == 0
    path = home / "Library/LaunchAgents/org.me.watch.plist"
    assert fake.lines() == ["launchctl print gui/501/org.me.watch", "launchctl bootout gui/501/org.me.watch",
                            f"launchctl bootstrap gui/501 {path}"]
    assert all(SYNOPSIS[line.split()[1]].match(line) for line in fake.lines())
    assert "launchctl kill SIGHUP gui/501/org.me.watch" in capsys.readouterr().out


def test_install_refuses_a_config_that_does_not_validate(mac, config_file, capsys):
    """It would exit 2 at every start, every ThrottleInterval: refused, nothing written or loaded."""
    home, fake = mac
    config = config_file("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, uid: -3}}]\n")
    assert run(["launchd", "install", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "restart.uid" in err and "not installed" in err
    assert fake.calls == [] and not (home / "Library/LaunchAgents").exists()


def test_install_refuses_a_missing_config(mac, tmp_path, capsys):
    home, fake = mac
    assert run(["launchd", "install", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "no such config file" in capsys.readouterr().err
    assert fake.calls == []


def test_install_never_overwrites_a_plist_it_did_not_write(mac, config_file, capsys):
    home, fake = mac
    config = config_file(GOOD_CONFIG)
    foreign = home / "Library/LaunchAgents/com.mlxwatch.daemon.plist"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(plistlib.dumps({"Label": "com.mlxwatch.daemon", "ProgramArguments": ["/bin/sh", "-c", "x"]}))
    assert run(["launchd", "install", "--config", str(config)]) == 2
    assert "not an mlxwatch agent; --force replaces it" in capsys.readouterr().err
    assert plistlib.loads(foreign.read_bytes())["ProgramArguments"][0] == "/bin/sh" and fake.calls == []
    assert run(["launchd", "install", "--config", str(config), "--force"]) == 0
    assert Path(plistlib.loads(foreign.read_bytes())["ProgramArguments"][0]).name == "mlxwatch"


def test_install_never_boots_out_a_label_loaded_from_another_file(mac, config_file, capsys):
    """The recorded boxen output: that label runs from /Library/LaunchDaemons, not our plist."""
    home, fake = mac
    fake.loaded["dev.mysql"] = recorded("launchctl-print-boxen-104.txt")
    assert run(["launchd", "install", "--config", str(config_file(GOOD_CONFIG)), "--label", "dev.mysql"]) == 2
    assert "is loaded from /Library/LaunchDaemons/dev.mysql.plist" in capsys.readouterr().err
    assert [c[1] for c in fake.calls] == ["print"]


def test_without_launchctl_install_and_uninstall_say_so_in_one_line(mac, monkeypatch, config_file, capsys):
    monkeypatch.setattr(launchctl, "available", lambda: False)
    assert run(["launchd", "install", "--config", str(config_file(GOOD_CONFIG))]) == 2
    assert run(["launchd", "uninstall"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mlxwatch: launchctl not found: launchd agents exist only on macOS"] * 2


def test_install_as_root_is_refused(mac, monkeypatch, config_file, capsys):
    """As root the agent would go to gui/0, which is no user's login session."""
    monkeypatch.setattr(launchctl, "effective_uid", lambda: 0)
    assert run(["launchd", "install", "--config", str(config_file(GOOD_CONFIG))]) == 2
    assert "not as root" in capsys.readouterr().err


def test_failed_bootstrap_exits_1_with_launchctls_reason(mac, config_file, capsys):
    """Homebrew/homebrew-services#528: `Bootstrap failed: 5: Input/output error`, exit 5."""
    home, fake = mac
    fake.fail["bootstrap"] = launchctl.Result(5, "", "Bootstrap failed: 5: Input/output error\n"
                                                     "Try re-running the command as root for richer errors.\n")
    assert run(["launchd", "install", "--config", str(config_file(GOOD_CONFIG))]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Bootstrap failed: 5: Input/output error" in err


def test_uninstall_boots_out_and_removes_only_the_agent(mac, config_file, tmp_path, capsys):
    home, fake = mac
    state = tmp_path / "state"
    state.mkdir()
    (state / "incidents.jsonl").write_text("{}\n")
    assert run(["launchd", "install", "--config", str(config_file(GOOD_CONFIG))]) == 0
    fake.calls.clear()
    assert run(["launchd", "uninstall"]) == 0
    assert fake.lines() == ["launchctl print gui/501/com.mlxwatch.daemon", "launchctl bootout gui/501/com.mlxwatch.daemon"]
    assert SYNOPSIS["bootout"].match(fake.lines()[1])
    assert not (home / "Library/LaunchAgents/com.mlxwatch.daemon.plist").exists()
    assert (state / "incidents.jsonl").exists()
    assert "removed" in capsys.readouterr().out
    assert run(["launchd", "uninstall"]) == 0  # nothing left: says so, exit 0
    assert "nothing to uninstall" in capsys.readouterr().out


def test_uninstall_refuses_a_plist_it_did_not_write(mac, capsys):
    home, fake = mac
    foreign = home / "Library/LaunchAgents/org.other.plist"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("not even a plist")
    assert run(["launchd", "uninstall", "--label", "org.other"]) == 2
    assert foreign.exists() and "--force" in capsys.readouterr().err


@pytest.mark.parametrize("label", ["../evil", "a/b", "", "-x", "com.mlx watch"])
def test_a_label_that_is_not_a_label_is_one_line_exit_2(mac, label, capsys):
    assert run(["launchd", "uninstall", f"--label={label}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "launchd label" in err


def test_install_refuses_a_config_with_nothing_to_watch(mac, config_file, capsys):
    """An empty config loads, but `run` refuses it: the agent would exit 2 at every start."""
    home, fake = mac
    config = config_file("")
    assert run(["launchd", "install", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no instances to watch" in err and "not installed" in err
    assert fake.calls == [] and not (home / "Library/LaunchAgents").exists()
