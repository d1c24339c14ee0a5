"""The config file: instances to watch, how to probe them, how to restart them.

Loaded once and validated whole; every problem becomes one ``ConfigError`` line naming the file,
the key path (``instances[1].probe.timeout``) and the offending value::

    cfg = load_config(resolve_config_path(None))
    for inst in cfg.instances:
        print(inst.name, inst.url, inst.probe.interval)

Defaults suit a Mac serving a ~26B model: a probe every 30 s, 45 s for the first token, a
confirming probe 10 s after a failure, two consecutive failures before a verdict, and up to ten
minutes of grace while real progress shows. Worst-case detection is about two minutes, against
five minutes and more for a cron job probing every five minutes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import yaml

from mlxwatch.durations import parse_duration
from mlxwatch.errors import ConfigError

CONFIG_ENV = "MLXWATCH_CONFIG"
DEFAULT_CONFIG_PATH = Path("~/.config/mlxwatch/config.yaml")


@dataclass(frozen=True)
class ProbeConfig:
    """How one instance is probed and judged."""

    interval: float = 30.0  # between probes while healthy
    first_token_timeout: float = 45.0  # request sent -> first delivered token
    timeout: float = 90.0  # request sent -> stream finished
    suspect_interval: float = 10.0  # after a failed probe: confirm (or clear) quickly
    max_tokens: int = 4
    failures: int = 2  # consecutive failed probes before a verdict
    grace_ceiling: float = 600.0  # most extra time that visible progress may buy
    endpoint_timeout: float = 5.0  # /health and /v1/models
    startup_timeout: float = 600.0  # after a restart: large models take minutes to load


@dataclass(frozen=True)
class RestartConfig:
    """How to restart an instance, and the limits that stop a restart loop."""

    method: str = "none"  # launchd | systemd | command | signal | none
    target: str = ""  # launchd label or systemd unit
    domain: str = "gui"  # launchd domain: gui | user | system
    user: bool = False  # systemd --user
    argv: tuple[str, ...] = ()  # command
    signal_name: str = "SIGTERM"  # signal
    grace: float = 15.0  # signal: SIGTERM -> SIGKILL
    timeout: float = 60.0  # the restart action itself
    backoff: float = 30.0  # first wait between restarts; doubles each time
    max_backoff: float = 600.0
    budget: int = 3  # restarts allowed ...
    window: float = 1800.0  # ... within this many seconds
    cooldown: float = 3600.0  # gave-up -> try again after this


@dataclass(frozen=True)
class InstanceConfig:
    """One ``mlx_lm.server`` to watch."""

    name: str
    url: str
    log: Path | None = None
    pid_file: Path | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class CaptureConfig:
    """What an evidence bundle holds and where bundles live."""

    dir: Path | None = None  # default: <state_dir>/bundles
    snapshots: int = 3
    spacing: float = 2.0
    ceiling: float = 60.0
    sudo: bool = False  # prefix py-spy/spindump with `sudo -n` (macOS needs root)
    log_tail_lines: int = 400
    keep: int = 50  # newest bundles kept per directory
    max_bytes: int = 2 * 1024**3  # all bundles together


@dataclass(frozen=True)
class Config:
    """The whole validated file."""

    path: Path | None = None
    instances: tuple[InstanceConfig, ...] = ()
    state_dir: Path | None = None
    notify: tuple[str, ...] = ()
    capture: CaptureConfig = field(default_factory=CaptureConfig)

    def instance(self, name: str) -> InstanceConfig:
        for inst in self.instances:
            if inst.name == name:
                return inst
        known = ", ".join(i.name for i in self.instances) or "none"
        raise ConfigError(str(self.path), "instances", f"no instance named {name!r} (known: {known})")


def resolve_config_path(explicit: str | os.PathLike[str] | None) -> Path:
    """``--config``, else ``$MLXWATCH_CONFIG``, else ``~/.config/mlxwatch/config.yaml``."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser()
    return DEFAULT_CONFIG_PATH.expanduser()


def default_state_dir() -> Path:
    """Where the journal and state live when the config does not say."""
    if sys.platform == "darwin":
        return Path("~/Library/Application Support/mlxwatch").expanduser()
    base = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(base).expanduser() / "mlxwatch"


def load_config(path: Path) -> Config:
    """Read and validate ``path``. Raises ``ConfigError`` with one line on any problem."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(file, "", "file not found") from None
    except OSError as exc:
        raise ConfigError(file, "", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(file, "", f"invalid YAML{where}: {problem}") from None
    return parse_config(data, file, path)


def parse_config(data: Any, file: str, path: Path | None = None) -> Config:
    """Validate already-parsed YAML data (a mapping) into a ``Config``."""
    if data is None:
        data = {}
    top = _Section(data, "", file)
    base = path.parent if path else Path.cwd()
    state_dir = top.take("state_dir", _path(base), None)
    notify = top.take("notify", _argv, ())
    capture = _capture(top.section("capture"), base)
    raw_instances = top.take("instances", _list, [])
    top.done()
    instances = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_instances):
        inst = _instance(_Section(raw, f"instances[{i}]", file), base)
        if inst.name in seen:
            raise ConfigError(
                file,
                f"instances[{i}].name",
                f"duplicate name {inst.name!r} (also instances[{seen[inst.name]}])",
            )
        seen[inst.name] = i
        instances.append(inst)
    return Config(path, tuple(instances), state_dir, notify, capture)


# --- field readers: each takes (value, describe) and returns the typed value or raises ValueError


def _positive_duration(value: Any) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError:
        raise ValueError("must be a duration such as 30, 30s, 5m or 1h") from None
    if seconds <= 0:
        raise ValueError("must be a positive duration")
    return seconds


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be a whole number")
    if value <= 0:
        raise ValueError("must be a positive whole number")
    return value


def _size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        units = {"kb": 1024, "mb": 1024**2, "gb": 1024**3, "b": 1}
        low = value.strip().lower()
        for unit, factor in units.items():
            if low.endswith(unit) and low[: -len(unit)].strip().replace(".", "", 1).isdigit():
                size = int(float(low[: -len(unit)]) * factor)
                if size > 0:
                    return size
    raise ValueError("must be a positive size such as 500MB or 2GB")


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise ValueError("must be a list")
    return value


def _argv(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError("must be a non-empty list of strings (an argv, run without a shell)")
    return tuple(value)


def _path(base: Path) -> Callable[[Any], Path]:
    def read(value: Any) -> Path:
        p = Path(_string(value)).expanduser()
        return p if p.is_absolute() else base / p

    return read


def parse_base_url(value: Any) -> str:
    """A server base URL (http[s]://host:port, no path), without a trailing slash. ValueError otherwise."""
    text = _string(value)
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - reading it raises ValueError for a port out of range
    except ValueError:
        raise ValueError("must be a URL such as http://127.0.0.1:8080") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be a URL such as http://127.0.0.1:8080")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("must be the server's base URL, without a path")
    return text.rstrip("/")


class _Section:
    """A mapping being read: take() known keys, then done() rejects what is left."""

    def __init__(self, data: Any, path: str, file: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(file, path or "(top level)", f"must be a mapping (got {_show(data)})")
        self.data = dict(data)
        self.path = path
        self.file = file

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(self.file, self.key_path(key), message)

    def take(self, key: str, read: Callable[[Any], Any], default: Any) -> Any:
        if key not in self.data:
            return default
        value = self.data.pop(key)
        try:
            return read(value)
        except ValueError as exc:
            raise self.error(key, f"{exc} (got {_show(value)})") from None

    def require(self, key: str, read: Callable[[Any], Any]) -> Any:
        if key not in self.data:
            raise self.error(key, "is required")
        return self.take(key, read, None)

    def section(self, key: str) -> "_Section":
        return _Section(self.data.pop(key, {}) or {}, self.key_path(key), self.file)

    def done(self) -> None:
        for key in self.data:
            raise self.error(str(key), f"unknown key (got {_show(self.data[key])})")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _probe(sec: _Section) -> ProbeConfig:
    d = ProbeConfig()
    probe = ProbeConfig(
        interval=sec.take("interval", _positive_duration, d.interval),
        suspect_interval=sec.take("suspect_interval", _positive_duration, d.suspect_interval),
        first_token_timeout=sec.take("first_token_timeout", _positive_duration, d.first_token_timeout),
        timeout=sec.take("timeout", _positive_duration, d.timeout),
        max_tokens=sec.take("max_tokens", _positive_int, d.max_tokens),
        failures=sec.take("failures", _positive_int, d.failures),
        grace_ceiling=sec.take("grace_ceiling", _positive_duration, d.grace_ceiling),
        endpoint_timeout=sec.take("endpoint_timeout", _positive_duration, d.endpoint_timeout),
        startup_timeout=sec.take("startup_timeout", _positive_duration, d.startup_timeout),
    )
    sec.done()
    if probe.first_token_timeout > probe.timeout:
        raise sec.error(
            "first_token_timeout",
            f"must not exceed probe.timeout ({probe.timeout:g}s) (got {probe.first_token_timeout:g}s)",
        )
    return probe


RESTART_METHODS = ("launchd", "systemd", "command", "signal", "none")
_SIGNALS = ("SIGTERM", "SIGINT", "SIGKILL", "SIGHUP", "SIGQUIT")


def _restart(raw: Any, path: str, file: str) -> RestartConfig:
    if raw is None or raw == "none":
        return RestartConfig()
    sec = _Section(raw, path, file)
    methods = [m for m in RESTART_METHODS if m in sec.data]
    if len(methods) != 1:
        raise ConfigError(
            file,
            path,
            f"must name exactly one method of {', '.join(RESTART_METHODS)} (got {_show(sorted(sec.data))})",
        )
    method = methods[0]
    d = RestartConfig()
    kwargs: dict[str, Any] = {"method": method}
    if method == "launchd":
        kwargs["target"] = sec.take("launchd", _string, "")
        kwargs["domain"] = sec.take("domain", _choice(("gui", "user", "system")), d.domain)
    elif method == "systemd":
        kwargs["target"] = sec.take("systemd", _string, "")
        kwargs["user"] = sec.take("user", _bool, d.user)
    elif method == "command":
        kwargs["argv"] = sec.take("command", _argv, ())
    elif method == "signal":
        kwargs["signal_name"] = sec.take("signal", _signal_name, d.signal_name)
        kwargs["grace"] = sec.take("grace", _positive_duration, d.grace)
    else:
        sec.take("none", lambda v: v, None)
    for key in ("timeout", "backoff", "max_backoff", "window", "cooldown"):
        kwargs[key] = sec.take(key, _positive_duration, getattr(d, key))
    kwargs["budget"] = sec.take("budget", _positive_int, d.budget)
    sec.done()
    return RestartConfig(**kwargs)


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def read(value: Any) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return read


def _signal_name(value: Any) -> str:
    if value is True:
        return "SIGTERM"
    name = str(value).upper()
    name = name if name.startswith("SIG") else "SIG" + name
    if name not in _SIGNALS:
        raise ValueError(f"must be true or one of {', '.join(_SIGNALS)}")
    return name


def _instance(sec: _Section, base: Path) -> InstanceConfig:
    name = sec.require("name", _string)
    url = sec.require("url", parse_base_url)
    log = sec.take("log", _path(base), None)
    pid_file = sec.take("pid_file", _path(base), None)
    probe = _probe(sec.section("probe"))
    restart = _restart(sec.data.pop("restart", None), sec.key_path("restart"), sec.file)
    sec.done()
    return InstanceConfig(name, url, log, pid_file, probe, restart)


def _capture(sec: _Section, base: Path) -> CaptureConfig:
    d = CaptureConfig()
    cap = CaptureConfig(
        dir=sec.take("dir", _path(base), None),
        snapshots=sec.take("snapshots", _positive_int, d.snapshots),
        spacing=sec.take("spacing", _positive_duration, d.spacing),
        ceiling=sec.take("ceiling", _positive_duration, d.ceiling),
        sudo=sec.take("sudo", _bool, d.sudo),
        log_tail_lines=sec.take("log_tail_lines", _positive_int, d.log_tail_lines),
        keep=sec.take("keep", _positive_int, d.keep),
        max_bytes=sec.take("max_bytes", _size, d.max_bytes),
    )
    sec.done()
    return cap
