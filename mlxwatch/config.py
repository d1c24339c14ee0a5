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

import datetime
import difflib
import ipaddress
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlsplit

import yaml
from yaml.constructor import ConstructorError

from mlxwatch.durations import DURATION_FORM, NOT_A_DURATION, parse_duration
from mlxwatch.errors import ConfigError

CONFIG_ENV = "MLXWATCH_CONFIG"
DEFAULT_CONFIG_PATH = Path("~/.config/mlxwatch/config.yaml")

# Bounds on what a config file may be. A real one is a few kilobytes, a few levels deep, with
# perhaps a handful of aliases; these stop a wrong path (a FIFO, /dev/zero, a log file) or a
# hostile file (billion laughs) from hanging or exhausting the loader.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_ALIASES = 100
MAX_DEPTH = 32  # nesting of mappings and lists, aliases followed
MAX_NODES = 10_000  # values in the document, each alias counted as everything it stands for
MIN_DURATION = 0.001
MAX_COUNT = 1_000_000  # any whole-number setting
MAX_SIZE = 1024**4  # capture.max_bytes


@dataclass(frozen=True)
class ProbeConfig:
    """How one instance is probed and judged."""

    interval: float = 30.0  # between probes while healthy
    first_token_timeout: float = 45.0  # request sent -> first delivered token
    timeout: float = 90.0  # request sent -> stream finished
    suspect_interval: float = 10.0  # after a failed probe: confirm (or clear) quickly
    max_tokens: int = 4
    failures: int = 2  # consecutive failed probes before a verdict
    grace_ceiling: float = 900.0  # most extra time that visible progress may buy
    endpoint_timeout: float = 5.0  # /health and /v1/models
    startup_timeout: float = 600.0  # after a restart: large models take minutes to load
    stall_timeout: float = 60.0  # launch shim: requests in flight and no token this long -> suspect at once
    quiet_window: float = 8.0  # kernel sight: nothing sent to any client this long ends a probe's wait


@dataclass(frozen=True)
class RestartConfig:
    """How to restart an instance, and the limits that stop a restart loop."""

    method: str = "none"  # launchd | systemd | command | signal | none
    target: str = ""  # launchd label or systemd unit
    domain: str = "gui"  # launchd domain: gui | user | system
    user: bool = False  # systemd --user
    argv: tuple[str, ...] = ()  # command
    signal_name: str = "SIGTERM"  # signal
    grace: float = 15.0  # signal: SIGTERM -> SIGKILL; any method: how long a group's ranks may outlive it
    timeout: float = 60.0  # the restart action itself
    backoff: float = 30.0  # first wait between restarts; doubles each time
    max_backoff: float = 600.0
    budget: int = 3  # restarts allowed ...
    window: float = 1800.0  # ... within this many seconds
    cooldown: float = 3600.0  # gave-up -> try again after this
    uid: int | None = None  # launchd gui/user domain's uid; default: the server's owner (never root's own)


@dataclass(frozen=True)
class FrontConfig:
    """The front door (``mlxwatch.front``): an optional proxy in front of one instance that sees
    every client's tokens, fails requests loudly when the server hangs, and gates them while it
    restarts. Off unless the instance has a ``front`` section; ``listen`` is then required and is
    ``(host, port)`` as ``metrics.listen`` is: a host that is not loopback needs ``expose: true``."""

    listen: tuple[str, int] = ("127.0.0.1", 8081)
    expose: bool = False
    stall_timeout: float = 10.0  # requests in flight and no token delivered to anyone this long -> suspect now
    request_stall_timeout: float = 60.0  # one request with no token this long while others flow -> failed loudly alone
    hold: float = 0.0  # while restarting: 0 = 503 + Retry-After at once; > 0 = hold a new request up to this long
    replay: bool = False  # resend once to the recovered server a request that had received no byte
    max_body: int = 16 * 1024**2  # request body limit (413)
    max_header: int = 64 * 1024  # request header limit (431)
    connect_ahead: bool = True  # keep a connection made ahead to a server that closes each one (mlx_lm.server)
    max_buffered: int = 128 * 1024**2  # request bodies held, all connections together (503 beyond)
    record: bool = False  # keep the requests of the last record_max_age (bodies: users' words) for bundles and replay
    record_max_age: float = 600.0  # the recorder keeps requests this long ...
    record_max_bytes: int = 256 * 1024**2  # ... and at most this many bytes of them


@dataclass(frozen=True)
class MemoryConfig:
    """The server's memory, read each probe cycle: out of memory foreseen from its trend
    (docs/deciding.md, "Memory")."""

    watch: str = "auto"  # auto (read where the OS lets mlxwatch) | off
    window: float = 600.0  # the trend: a straight line through this long's readings
    warn_within: float = 1800.0  # warn when the trend says out of memory within this long
    restart_early: bool = False  # opt-in: drain and restart before it dies, at a quiet moment
    restart_within: float = 300.0  # ... once the trend says out of memory within this long
    release_timeout: float = 60.0  # after a server stopped: the most to wait for its memory before the next starts


@dataclass(frozen=True)
class InstanceConfig:
    """One ``mlx_lm.server`` to watch."""

    name: str
    url: str
    log: Path | None = None
    pid_file: Path | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    shim: str = "auto"  # launch shim heartbeat: auto (use it when present) | required (warn when missing) | off
    front: FrontConfig | None = None  # the front door; None: off (clients talk to the server directly)
    kernel: str = "auto"  # kernel sight (bytes sent to every client): auto (used where the OS allows) | off
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    @property
    def port(self) -> int:
        return url_port(self.url)


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
    keep_days: int = 90  # bundles older than this are deleted (incomplete and unfinished ones too)
    min_free_bytes: int = 1024**3  # below this much free disk, no bundle: a one-line note instead
    stacks: str = "auto"  # Python stack source: auto (shim if present, else py-spy) | pyspy | shim | sample
    requests: str = "metadata"  # the front door's requests in a bundle: metadata | bodies (redacted request bodies too)
    redact: bool = True  # the raw bundle without secret environment values and URL passwords; false: complete


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics: off unless ``listen`` or ``textfile`` is set.

    ``listen`` is ``(host, port)``; a host that is not a loopback address is accepted only with
    ``expose: true``, so serving beyond this machine is always a written decision."""

    listen: tuple[str, int] | None = None
    textfile: Path | None = None  # for node_exporter's textfile collector; must end in .prom
    expose: bool = False

    @property
    def enabled(self) -> bool:
        return self.listen is not None or self.textfile is not None


@dataclass(frozen=True)
class Config:
    """The whole validated file."""

    path: Path | None = None
    instances: tuple[InstanceConfig, ...] = ()
    state_dir: Path | None = None
    notify: tuple[str, ...] = ()
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def instance(self, name: str) -> InstanceConfig:
        for inst in self.instances:
            if inst.name == name:
                return inst
        known = ", ".join(i.name for i in self.instances) or "none"
        raise ConfigError(str(self.path), "instances", f"no instance named {name!r} (known: {known})")


def resolve_config_path(explicit: str | os.PathLike[str] | None) -> Path:
    """``--config``, else ``$MLXWATCH_CONFIG``, else ``~/.config/mlxwatch/config.yaml``. A
    ``$MLXWATCH_CONFIG`` set but empty (an unset variable in a unit file, often) is refused,
    as ``--config ""`` is: falling back would read another config."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(CONFIG_ENV) == "":
        raise ConfigError(f"${CONFIG_ENV}", "", "set but empty: give a config file, or unset it "
                          f"(then {DEFAULT_CONFIG_PATH})")
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser()
    return DEFAULT_CONFIG_PATH.expanduser()


def missing_config_hint(path: Path) -> str:
    """What to do about a config file that does not exist: every command says it in these words
    (`run` did; `config validate`, `check --instance` and `launchd plist` said only "file not
    found"). ``config init`` writes to the default path by itself; elsewhere it needs ``--out``."""
    try:
        default = resolve_config_path(None)
    except ConfigError:
        default = None
    init = "mlxwatch config init" if path == default else f"mlxwatch config init --out {_display(str(path))}"
    return f"write one with `{init}` (finds running mlx-lm servers) or see `mlxwatch config example`"


def default_state_dir() -> Path:
    """Where the journal and state live when the config does not say."""
    if sys.platform == "darwin":
        return Path("~/Library/Application Support/mlxwatch").expanduser()
    base = os.environ.get("XDG_STATE_HOME") or "~/.local/state"
    return Path(base).expanduser() / "mlxwatch"


def state_dir_for(config: Config, override: Path | None = None) -> Path:
    """The state dir: ``--state-dir``, else the config's ``state_dir``, else the platform's."""
    return override or config.state_dir or default_state_dir()


def default_bundles_dir(state_dir: Path) -> Path:
    """Where bundles go when ``capture.dir`` is not set."""
    return state_dir / "bundles"


def bundles_dir_for(config: Config, state_dir: Path) -> Path:
    """The bundles dir: ``capture.dir``, else ``<state_dir>/bundles``."""
    return config.capture.dir or default_bundles_dir(state_dir)


def load_config(path: Path) -> Config:
    """Read and validate ``path``. Raises ``ConfigError`` with one line on any problem."""
    file = _display(str(path))
    raw = _read_bounded(path, file)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(file, "", f"not UTF-8 text at byte {exc.start}") from None
    return parse_config(_parse_yaml(text, file), file, path)


def check_runnable(config: Config) -> Config:
    """The one rule for "can the daemon run this config?", beyond a valid file: `run`, a SIGHUP
    reload, `config validate`, `launchd plist` and `launchd install` all ask it, so no command
    accepts a file another refuses. Returns ``config``; raises ``ConfigError`` (one line)."""
    if not config.instances:
        raise ConfigError(_display(str(config.path)), "instances",
                          "no instances to watch (`mlxwatch config init` writes a starter)")
    return config


def load_runnable_config(path: Path) -> Config:
    """``load_config`` then ``check_runnable``: a config the daemon can start (or reload) with."""
    return check_runnable(load_config(path))


def _read_bounded(path: Path, file: str) -> bytes:
    """The file's bytes: a regular file of at most ``MAX_CONFIG_BYTES``, else ConfigError.

    The type is checked before opening (opening a FIFO would wait for a writer) and again on the
    open descriptor, opened non-blocking in case the path was swapped in between; at most one
    byte more than the limit is ever read, whatever the file claims its size is.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(file, "", f"not a regular file ({_file_kind(mode)})")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ConfigError(file, "", f"file not found: {missing_config_hint(path)}") from None
    except OSError as exc:
        raise ConfigError(file, "", f"cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(file, "", f"cannot read: {exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(file, "", f"not a regular file ({_file_kind(mode)})")
        chunks: list[bytes] = []
        left = MAX_CONFIG_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ConfigError(file, "", f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if left <= 0:
        raise ConfigError(file, "", f"too large (more than {MAX_CONFIG_BYTES} bytes)")
    return b"".join(chunks)


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a file")


def _display(file: str) -> str:
    """A file name fit for a one-line message (a newline in a name would break the line)."""
    return file if file.isprintable() else repr(file)


class _Refused(Exception):
    """The document is valid YAML but over one of the bounds."""

    def __init__(self, message: str, mark: Any) -> None:
        super().__init__(f"{message} at line {mark.line + 1}, column {mark.column + 1}")


class _Duplicate(Exception):
    def __init__(self, key_path: str, message: str) -> None:
        super().__init__(message)
        self.key_path = key_path
        self.message = message


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts while composing: aliases, nesting, and values with aliases expanded.

    PyYAML builds one shared object per anchor, so loading a billion-laughs document is cheap;
    what explodes is anything that then walks the result (a repr in an error message, a check
    that visits every value). Composition sees every alias before any Python object exists, so
    the limits are enforced there. Each node's expanded size and height are recorded once, so a
    node reached through many aliases costs nothing more to measure.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0
        self.depth = 0
        self.composed = 0
        self.measure: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, height)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Refused(f"more than {MAX_ALIASES} YAML aliases", event.start_mark)
            node = super().compose_node(parent, index)
            if id(node) not in self.measure:  # an alias to a node still being composed
                raise _Refused(f"YAML alias *{event.anchor} refers to a value that contains it", event.start_mark)
            return node
        self.depth += 1
        self.composed += 1
        if self.depth > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
        if self.composed > MAX_NODES:
            raise _Refused(f"more than {MAX_NODES} values", event.start_mark)
        node = super().compose_node(parent, index)
        self.depth -= 1
        children = _children(node)
        size = 1 + sum(self.measure[id(c)][0] for c in children)
        height = 1 + max((self.measure[id(c)][1] for c in children), default=0)
        self.measure[id(node)] = (size, height)
        if size > MAX_NODES:
            raise _Refused(f"more than {MAX_NODES} values with aliases expanded", node.start_mark)
        if height > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels with aliases expanded", node.start_mark)
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:  # int("9" * 5000), a date such as 2024-13-45
            if node.tag.endswith(":int"):
                problem = "integer too long"
            elif node.tag.endswith(":timestamp"):
                problem = f"not a valid date ({exc})"
            else:
                problem = str(exc).split(";")[0]
            value = _show(node.value) if isinstance(node, yaml.ScalarNode) else node.tag
            raise ConstructorError(None, None, f"cannot read {value}: {problem}", node.start_mark) from None


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _parse_yaml(text: str, file: str) -> Any:
    loader = None
    try:
        loader = _BoundedLoader(text)  # the reader rejects control characters right here
        node = loader.get_single_node()
        if node is None:
            return None
        _reject_duplicate_keys(loader, node)
        return loader.construct_document(node)
    except _Refused as exc:
        raise ConfigError(file, "", str(exc)) from None
    except _Duplicate as exc:
        raise ConfigError(file, exc.key_path, exc.message) from None
    except yaml.YAMLError as exc:
        raise ConfigError(file, "", _yaml_problem(exc, text)) from None
    finally:
        if loader is not None:
            loader.dispose()


def _yaml_problem(exc: yaml.YAMLError, text: str) -> str:
    if isinstance(exc, yaml.reader.ReaderError):  # a control character: no problem_mark of its own
        pos = exc.position
        line = text.count("\n", 0, pos) + 1
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"invalid YAML at line {line}, column {column}: {exc.reason} (#x{char:04x})"
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or "syntax error"
    context = getattr(exc, "context", None) or ""
    if context.startswith("found duplicate anchor"):  # its problem is just "second occurrence"
        problem = context.split(";")[0]
    elif str(problem).startswith("but "):  # "expected a single document ..., but found another document"
        problem = f"{context}, {problem}"
    return f"invalid YAML{where}: {' '.join(str(problem).split())}"


def _reject_duplicate_keys(loader: _BoundedLoader, root: Any) -> None:
    """PyYAML keeps the last of two equal keys; a config that says a thing twice is an error.

    Each mapping node is checked once, under the first key path that reaches it.
    """
    seen_nodes: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(node.value))))
        elif isinstance(node, yaml.MappingNode):
            keys: dict[Any, Any] = {}
            children = []
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = loader.construct_object(key_node)
                key_path = _join(path, key)
                if key in keys:
                    first, again = keys[key].start_mark.line + 1, key_node.start_mark.line + 1
                    where = f"lines {first} and {again}" if first != again else f"twice on line {first}"
                    raise _Duplicate(key_path, f"duplicate key ({where})")
                keys[key] = key_node
                children.append((value_node, key_path))
            stack.extend(reversed(children))


def _join(path: str, key: Any) -> str:
    name = _key_name(key)
    return f"{path}.{name}" if path else name


def _key_name(key: Any) -> str:
    """A key as it appears in a key path: bare if it is a plain word, else quoted."""
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,60}", key):
        return key
    return _show(key)


def parse_config(data: Any, file: str, path: Path | None = None) -> Config:
    """Validate already-parsed YAML data (a mapping) into a ``Config``."""
    if data is None:
        data = {}
    top = _Section(data, "", file)
    base = path.parent if path else Path.cwd()
    state_dir = top.take("state_dir", _path(base), None)
    notify = top.take("notify", _argv, ())
    capture = _capture(top.section("capture"), base)
    metrics = _metrics(top.section("metrics"), base)
    raw_instances = top.take("instances", _list, [])
    top.done()
    instances: list[InstanceConfig] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_instances):
        inst = _instance(_Section(raw, f"instances[{i}]", file), base)
        if inst.name in seen:
            raise ConfigError(
                file,
                f"instances[{i}].name",
                f"duplicate name {inst.name!r} (also instances[{seen[inst.name]}])",
            )
        for j, other in enumerate(instances):
            if same_address(inst.url, other.url):
                raise ConfigError(
                    file,
                    f"instances[{i}].url",
                    f"same address as instances[{j}] ({other.name!r} at {other.url}) (got {_show(inst.url)})",
                )
        _check_front_port(inst, i, instances, metrics, file)
        seen[inst.name] = i
        instances.append(inst)
    return Config(path, tuple(instances), state_dir, notify, capture, metrics)


def _check_front_port(inst: InstanceConfig, i: int, earlier: list[InstanceConfig], metrics: MetricsConfig,
                      file: str) -> None:
    """A front door's address is its own: not another instance's server or front door, nor metrics'."""
    taken = [(f"instances[{j}].url", other.url) for j, other in enumerate(earlier)]
    taken += [(f"instances[{j}].front.listen", f"http://{listen_address(other.front.listen)}")
              for j, other in enumerate(earlier) if other.front is not None]
    if inst.front is not None:
        mine = f"http://{listen_address(inst.front.listen)}"
        if metrics.listen is not None:
            taken.append(("metrics.listen", f"http://{listen_address(metrics.listen)}"))
        for where, url in taken:  # a server's url, or another bind (a door's, the metrics')
            if _takes_port(mine, url, both_bound=not where.endswith(".url"), b_dual_stack=where == "metrics.listen"):
                raise ConfigError(file, f"instances[{i}].front.listen",
                                  f"same address as {where} (got {listen_address(inst.front.listen)!r})")
    for j, other in enumerate(earlier):
        if other.front is not None and _takes_port(f"http://{listen_address(other.front.listen)}", inst.url,
                                                   both_bound=False):
            raise ConfigError(file, f"instances[{i}].url",
                              f"same address as instances[{j}].front.listen (got {_show(inst.url)})")


_LOOPBACKS = frozenset({"127.0.0.1", "::1"})
_WILDCARDS = frozenset({"0.0.0.0", "::"})


def _takes_port(a: str, b: str, *, both_bound: bool, b_dual_stack: bool = False) -> bool:
    """Whether the listener at ``a`` and the address ``b`` are one socket or contend for its port."""
    return same_address(a, b) or _wildcard_overlap(a, b, both_bound=both_bound, b_dual_stack=b_dual_stack)


def _wildcard_overlap(a: str, b: str, *, both_bound: bool, b_dual_stack: bool = False) -> bool:
    """Whether a wildcard bind (``0.0.0.0``, or ``::``, as a door with ``expose: true`` binds)
    takes the port of the other address, in the families it covers: ``0.0.0.0`` IPv4; ``::``
    IPv6 only for a door (asyncio sets IPV6_V6ONLY), both for the metrics (``b_dual_stack``);
    ``localhost`` may be either. The other address is another bind (``both_bound``), or a server
    judged only when its URL is this machine's (loopback, ``localhost``, a wildcard): a URL
    naming another host may be another machine, and a clash with this one's fails at bind."""
    if url_port(a) != url_port(b):
        return False
    ha, hb = (_host(urlsplit(u).hostname or "") for u in (a, b))
    if ha not in _WILDCARDS and hb not in _WILDCARDS:
        return False
    if not both_bound and not {ha, hb} <= _LOOPBACKS | _WILDCARDS | {"localhost"}:
        return False
    fa, fb = _families(ha, dual_stack=False), _families(hb, dual_stack=b_dual_stack)
    return fa is not None and fb is not None and bool(fa & fb)


def _families(host: str, *, dual_stack: bool) -> frozenset[int] | None:
    """The IP versions an address takes a port in (None: a name, not judged)."""
    if host == "localhost":
        return frozenset({4, 6})
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return None
    return frozenset({4, 6}) if host == "::" and dual_stack else frozenset({version})


def same_address(a: str, b: str) -> bool:
    """Whether two base URLs reach the same listening socket: same host and port.

    The scheme only decides the default port (a server listens on a port, and a watcher finds
    the server's process by that port). Hosts compare as written after normalising case, a
    trailing dot and IP notation (``[0:0::1]`` is ``[::1]``, ``::ffff:127.0.0.1`` is
    ``127.0.0.1``); ``localhost`` may resolve to either loopback, so it matches both
    ``127.0.0.1`` and ``::1``, while those two are different sockets.
    """
    pa, pb = urlsplit(a), urlsplit(b)
    if url_port(a) != url_port(b):
        return False
    ha, hb = _host(pa.hostname or ""), _host(pb.hostname or "")
    if ha == hb:
        return True
    return (ha == "localhost" and hb in _LOOPBACKS) or (hb == "localhost" and ha in _LOOPBACKS)


def url_port(url: str) -> int:
    """The TCP port a URL reaches: its own, else the scheme's (443 for https, 80 for http).
    The one place this is decided: lookup, address comparison and discovery all ask it."""
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def _host(host: str) -> str:
    host = host.lower().rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    return str(ip)


# --- field readers: each takes the value and returns the typed value or raises ValueError


def _positive_duration(value: Any) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise ValueError(DURATION_FORM if str(exc) == NOT_A_DURATION else str(exc)) from None
    if seconds <= 0:
        raise ValueError("must be a positive duration")
    if seconds < MIN_DURATION:
        raise ValueError("must be at least 1ms")
    return seconds


def _duration_or_zero(value: Any) -> float:
    """A duration where 0 means "not at all" (``front.hold``)."""
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise ValueError(DURATION_FORM if str(exc) == NOT_A_DURATION else str(exc)) from None
    if seconds < 0:
        raise ValueError("must be 0 or a positive duration")
    return seconds


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be a whole number")
    if value <= 0:
        raise ValueError("must be a positive whole number")
    if value > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT}")
    return value


_SIZE_UNITS = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(b|kb|mb|gb|kib|mib|gib)\s*", re.ASCII)
_SIZE_FORM = "must be a positive size such as 500MB or 2GB"


def _size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(_SIZE_FORM)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():  # bytes, as an int is
        size = int(value.strip()) if len(value.strip()) < 20 else MAX_SIZE + 1
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value.lower())):
        number = float(match.group(1))  # digits only: finite, or inf for hundreds of digits
        if number * _SIZE_UNITS[match.group(2)] > MAX_SIZE:
            raise ValueError(f"must be at most {MAX_SIZE // 1024**3}GB")
        size = int(number * _SIZE_UNITS[match.group(2)])
    else:
        raise ValueError(_SIZE_FORM)
    if size <= 0:
        raise ValueError(_SIZE_FORM)
    if size > MAX_SIZE:
        raise ValueError(f"must be at most {MAX_SIZE // 1024**3}GB")
    return size


def parse_size(value: Any) -> int:
    """A size as the config file reads it (``256MiB``, ``2GB``, bytes); ValueError in its words.
    The command line's sizes (``launch --record-max-bytes``) go through it too."""
    return _size(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    if not value.isprintable():
        raise ValueError("must not contain control characters")
    return value


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)


def _name(value: Any) -> str:
    """An instance name: it names files (resume requests, bundles), so no '/', no leading dot."""
    if not _NAME.fullmatch(_string(value)):
        raise ValueError("must be letters, digits, '.', '_' or '-' (at most 64), starting with a letter or digit")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise ValueError("must be a list")
    return value


# What a restart command's arguments may name, filled in when it runs (restart/methods.py).
# {launcher_pid}, {pids} (comma-separated, by rank) and {hosts} (likewise): an mlx.launch group's, else empty.
HOOK_FIELDS = ("name", "pid", "url", "bundle", "launcher_pid", "pids", "hosts")
HOOK_FIELD = re.compile(r"\{(" + "|".join(HOOK_FIELDS) + r")\}")
_FIELD_LIST = ", ".join(f"{{{f}}}" for f in HOOK_FIELDS[:-1]) + f" and {{{HOOK_FIELDS[-1]}}}"
_SQUEEZED_FIELDS = {f.replace("_", ""): f for f in HOOK_FIELDS}  # {launcherpid}: launcher_pid
# a brace and a name, closed or not; never ${VAR}: the shell's
_BRACED_NAME = re.compile(r"(?<!\$)\{([A-Za-z0-9_-]+)(\}|(?=\s|$))")


def _hook_argv(value: Any) -> tuple[str, ...]:
    """A restart command. A field in the wrong case ({PID}) or misspelt ({launcherpid},
    {launcher-pid}, {launcher_pid without its brace) is refused: it would reach the command as
    written, at restart time. Other braces (a shell's ${VAR}, awk's {print}, JSON) are the
    command's own and pass as written."""
    argv = _argv(value)
    for i, arg in enumerate(argv):
        for m in _BRACED_NAME.finditer(arg):
            word, closed = m.group(1), m.group(2) == "}"
            if closed and word in HOOK_FIELDS:
                continue
            meant = _near_field(word)
            if meant is None:
                continue
            written = "{" + word + ("}" if closed else "")
            raise ValueError(f"argument {i} has {written}, which mlxwatch does not fill: did you mean {{{meant}}}? "
                             f"Its fields are {_FIELD_LIST}")
    return argv


def _near_field(word: str) -> str | None:
    """The field ``word`` was most likely meant to be (case, ``-`` for ``_``, a letter off), or None."""
    plain = word.lower().replace("-", "_")
    if plain in HOOK_FIELDS:
        return plain
    if plain.replace("_", "") in _SQUEEZED_FIELDS:
        return _SQUEEZED_FIELDS[plain.replace("_", "")]
    close = difflib.get_close_matches(plain, HOOK_FIELDS, n=1, cutoff=0.85)
    return close[0] if close else None


def _argv(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError("must be a non-empty list of strings (an argv, run without a shell)")
    if not value[0].strip():
        raise ValueError("must start with a program to run")
    if any("\0" in a for a in value):
        raise ValueError("must not contain NUL characters")
    return tuple(value)


def _path(base: Path) -> Callable[[Any], Path]:
    def read(value: Any) -> Path:
        try:
            p = Path(_string(value)).expanduser()
        except RuntimeError:  # ~someone, and there is no such user
            raise ValueError("names an unknown home directory") from None
        return p if p.is_absolute() else base / p

    return read


def _log_file(base: Path) -> Callable[[Any], Path]:
    """A server's log file: it may not exist yet (the server creates it), but a directory is
    never one the daemon could follow."""
    read = _path(base)

    def check(value: Any) -> Path:
        path = read(value)
        if path.is_dir():
            raise ValueError("is a directory; give the file the server writes its log to")
        return path

    return check


class ValueNotShown(ValueError):
    """A value's refusal whose message already shows what may be shown of the value: the reader
    adds no ``(got ...)`` (a URL's query, fragment or password is never echoed)."""


_QUERY_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def _masked_url(text: str) -> str:
    """``text`` with its user and password, query values and fragment replaced by ``…``; the
    query's keys are kept when they look like names (``?api_key=…``)."""
    text, hash_, _ = text.partition("#")
    text, mark, query = text.partition("?")
    text = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/]*@", r"\1…@", text)
    if mark:
        keys = [pair.partition("=")[0] for pair in query.split("&")]
        text += "?" + "&".join(f"{k}=…" if _QUERY_KEY.fullmatch(k) else "…" for k in keys)
    return text + ("#…" if hash_ else "")


def parse_base_url(value: Any) -> str:
    """A server base URL (http[s]://host:port, no path), without a trailing slash. ValueError otherwise
    (``ValueNotShown``: the message shows the URL with any secret it may hold masked)."""
    text = _string(value)

    def refuse(why: str) -> ValueNotShown:
        return ValueNotShown(f"{why} (got {_show(_masked_url(text))})")

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - reading it raises ValueError for a port out of range
    except ValueError:
        raise refuse("must be a URL such as http://127.0.0.1:8080") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in text):
        raise refuse("must be a URL such as http://127.0.0.1:8080")
    if parts.username is not None or parts.password is not None:
        raise refuse("must not hold a user or password (mlx-lm has no authentication)")
    if parts.query:
        raise refuse("must be the server's base URL, without a query string (mlx-lm takes no key in its URL)")
    if parts.fragment:
        raise refuse("must be the server's base URL, without a #fragment")
    if parts.path not in ("", "/"):
        raise refuse("must be the server's base URL, without a path")
    if parts.port == 0:
        raise refuse("must name a real port (not 0)")
    return text.rstrip("/")


class _Section:
    """A mapping being read: take() known keys, then done() rejects what is left."""

    def __init__(self, data: Any, path: str, file: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(file, path or "(top level)", f"must be a mapping (got {_show(data)})")
        for key in data:
            if not isinstance(key, str):
                raise ConfigError(file, path or "(top level)", f"keys must be strings (got {_show(key)})")
        self.data = dict(data)
        self.path = path
        self.file = file
        self.asked: set[str] = set()  # every key read or looked for: what a typo was meant to be

    def key_path(self, key: str) -> str:
        return _join(self.path, key)

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(self.file, self.key_path(key), message)

    def take(self, key: str, read: Callable[[Any], Any], default: Any) -> Any:
        self.asked.add(key)
        if key not in self.data:
            return default
        value = self.data.pop(key)
        try:
            return read(value)
        except ValueNotShown as exc:
            raise self.error(key, str(exc)) from None
        except ValueError as exc:
            hint = ": YAML reads a bare on, off, yes or no as true or false" if isinstance(value, bool) else ""
            raise self.error(key, f"{exc} (got {_show(value)}{hint})") from None

    def take_present(self, readers: dict[str, Callable[[Any], Any]]) -> dict[str, Any]:
        """The keys of ``readers`` that the file sets, read; the dataclass supplies the rest."""
        self.asked.update(readers)
        return {key: self.take(key, read, None) for key, read in readers.items() if key in self.data}

    def require(self, key: str, read: Callable[[Any], Any]) -> Any:
        self.asked.add(key)
        if key not in self.data:
            typo = _meant_for(key, self.data)
            if typo is not None:  # `urll:` and no `url:`: name the key written, not only the one missing
                raise self.error(typo, f"unknown key: did you mean {key}? ({self.key_path(key)} is required)")
            raise self.error(key, "is required")
        return self.take(key, read, None)

    def section(self, key: str) -> "_Section":
        self.asked.add(key)
        value = self.data.pop(key, None)
        return _Section({} if value is None else value, self.key_path(key), self.file)

    def done(self) -> None:
        for key in self.data:
            meant = _meant_for(key, self.asked)
            hint = f": did you mean {meant}?" if meant is not None else ""
            raise self.error(key, f"unknown key (got {_show(self.data[key])}){hint}")


def _meant_for(word: str, keys: Iterable[str]) -> str | None:
    """The key in ``keys`` closest to ``word`` (case aside, a letter or two off), or None: a typo
    and the key it was meant to be, either way round."""
    def score(key: str) -> float:
        return difflib.SequenceMatcher(None, word.lower(), key.lower()).ratio()
    best = max(sorted(keys), key=score, default=None)
    return best if best is not None and score(best) >= 0.6 and best != word else None


def _show(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, computed only that far.

    The value may be anything parse_config was handed: a list that contains itself, a structure
    built from shared references that would print as gigabytes, an int too long for ``repr``.
    """
    out: list[str] = []
    length = 0
    for piece in _repr_pieces(value, 0):
        out.append(piece)
        length += len(piece)
        if length > 60:
            break
    text = "".join(out)
    return text if len(text) <= 60 else text[:57] + "..."


def _repr_pieces(value: Any, depth: int) -> Iterator[str]:
    if depth > 20:
        yield "..."
    elif isinstance(value, (list, tuple)):
        yield "[" if isinstance(value, list) else "("
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _repr_pieces(item, depth + 1)
        yield "]" if isinstance(value, list) else ",)" if len(value) == 1 else ")"
    elif isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _repr_pieces(key, depth + 1)
            yield ": "
            yield from _repr_pieces(item, depth + 1)
        yield "}"
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        yield f"<a {value.bit_length()}-bit integer>"
    elif isinstance(value, (str, bytes)):
        yield repr(value if len(value) <= 1000 else value[:1000])
    elif isinstance(value, bool) or value is None:  # as the YAML said it, not as Python spells it
        yield {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, (datetime.date, datetime.datetime)):
        yield f"the date {value.isoformat()}"  # YAML reads a bare 2001-12-14 as a date
    else:
        yield repr(value)[:1000]


def _probe(sec: _Section) -> ProbeConfig:
    probe = ProbeConfig(**sec.take_present({
        "interval": _positive_duration,
        "suspect_interval": _positive_duration,
        "first_token_timeout": _positive_duration,
        "timeout": _positive_duration,
        "max_tokens": _positive_int,
        "failures": _positive_int,
        "grace_ceiling": _positive_duration,
        "endpoint_timeout": _positive_duration,
        "startup_timeout": _positive_duration,
        "stall_timeout": _positive_duration,
        "quiet_window": _positive_duration,
    }))
    sec.done()
    if probe.first_token_timeout > probe.timeout:
        raise sec.error(
            "first_token_timeout",
            f"must not exceed probe.timeout ({probe.timeout:g}s) (got {probe.first_token_timeout:g}s)",
        )
    return probe


RESTART_METHODS = ("launchd", "systemd", "command", "signal", "none")
_SIGNALS = ("SIGTERM", "SIGINT", "SIGKILL", "SIGHUP", "SIGQUIT")
RESTART_FORMS = "{launchd: LABEL}, {systemd: UNIT}, {command: [PROGRAM, ARG, ...]}, {signal: SIGTERM}"


def _restart(raw: Any, path: str, file: str) -> RestartConfig:
    if raw is None or raw == "none":
        return RestartConfig()
    if not isinstance(raw, dict):  # `restart: reboot`: say what it can be, not only "a mapping"
        raise ConfigError(file, path, f"must be none or one of {RESTART_FORMS} (got {_show(raw)})")
    sec = _Section(raw, path, file)
    methods = [m for m in RESTART_METHODS if m in sec.data]
    if len(methods) != 1:
        raise ConfigError(
            file,
            path,
            f"must name exactly one method of {', '.join(RESTART_METHODS)} (got {_show(sorted(sec.data))})",
        )
    method = methods[0]
    kwargs: dict[str, Any] = {"method": method}
    if method == "launchd":
        kwargs["target"] = sec.require("launchd", _string)
        kwargs.update(sec.take_present({"domain": _choice(("gui", "user", "system")), "uid": _uid}))
        if kwargs.get("uid") is not None and kwargs.get("domain") == "system":
            raise sec.error("uid", "the system domain has no uid; drop uid or use domain gui or user "
                                   f"(got {kwargs['uid']})")
    elif method == "systemd":
        kwargs["target"] = sec.require("systemd", _string)
        kwargs.update(sec.take_present({"user": _bool}))
    elif method == "command":
        kwargs["argv"] = sec.require("command", _hook_argv)
    elif method == "signal":
        kwargs["signal_name"] = sec.require("signal", _signal_name)
    else:
        sec.take("none", lambda v: v, None)
    if method != "none":  # signal: the time to SIGKILL; every method: how long a group's ranks may outlive it
        kwargs.update(sec.take_present({"grace": _positive_duration}))
    kwargs.update(sec.take_present({
        "timeout": _positive_duration,
        "backoff": _positive_duration,
        "max_backoff": _positive_duration,
        "window": _positive_duration,
        "cooldown": _positive_duration,
        "budget": _positive_int,
    }))
    sec.done()
    return RestartConfig(**kwargs)


MAX_UID = 2**31 - 1  # uid_t values launchd's gui/<uid> and user/<uid> targets can name


def _uid(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be a user id, a whole number such as 501 (`id -u`)")
    if not 0 <= value <= MAX_UID:
        raise ValueError(f"must be a user id from 0 to {MAX_UID}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def read(value: Any) -> str:
        # YAML 1.1 reads a bare `off` (or `no`) as false: the word the user wrote, where it is one
        if value is False and "off" in options:
            return "off"
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return read


def _signal_name(value: Any) -> str:
    if value is True:
        return RestartConfig.signal_name
    name = value.upper() if isinstance(value, str) else ""
    name = name if name.startswith("SIG") else "SIG" + name
    if name not in _SIGNALS:
        raise ValueError(f"must be true or one of {', '.join(_SIGNALS)}")
    return name


def _instance(sec: _Section, base: Path) -> InstanceConfig:
    name = sec.require("name", _name)
    url = sec.require("url", parse_base_url)
    log = sec.take("log", _log_file(base), None)
    pid_file = sec.take("pid_file", _path(base), None)
    probe = _probe(sec.section("probe"))
    restart = _restart(sec.data.pop("restart", None), sec.key_path("restart"), sec.file)
    shim = sec.take("shim", _choice(SHIM_MODES), "auto")
    kernel = sec.take("kernel", _choice(KERNEL_MODES), "auto")
    front = _front(sec.section("front")) if "front" in sec.data else None  # an empty `front:` too: it asks for a door
    sec.asked.update(("restart", "front"))  # read above without take(): still what a typo may mean
    memory = _memory(sec.section("memory"))
    sec.done()
    if front is not None and _takes_port(f"http://{listen_address(front.listen)}", url, both_bound=False):
        raise ConfigError(sec.file, f"{sec.path}.front.listen",
                          "is the server's own address; the front door needs a port of its own"
                          f" (got {listen_address(front.listen)!r})")
    return InstanceConfig(name, url, log, pid_file, probe, restart, shim, front, kernel, memory)


def _memory(sec: _Section) -> MemoryConfig:
    memory = MemoryConfig(**sec.take_present({
        "watch": _choice(("auto", "off")),
        "window": _positive_duration,
        "warn_within": _positive_duration,
        "restart_early": _bool,
        "restart_within": _positive_duration,
        "release_timeout": _positive_duration,
    }))
    sec.done()
    return memory


def _front(sec: _Section) -> FrontConfig:
    """``instances[].front``: present means on; ``listen`` is required."""
    listen = sec.require("listen", _listen)
    front = FrontConfig(listen=listen, **sec.take_present({
        "expose": _bool,
        "stall_timeout": _positive_duration,
        "request_stall_timeout": _positive_duration,
        "hold": _duration_or_zero,
        "replay": _bool,
        "connect_ahead": _bool,
        "max_body": _size,
        "max_header": _size,
        "max_buffered": _size,
        "record": _bool,
        "record_max_age": _positive_duration,
        "record_max_bytes": _size,
    }))
    sec.done()
    if front.replay and front.hold <= 0:
        raise sec.error("replay", "needs front.hold above 0: a replayed request waits up to hold for the recovered "
                                  "server, so with hold 0 nothing would ever be replayed (got true)")
    if not front.expose and not ipaddress.ip_address(front.listen[0]).is_loopback:
        raise sec.error("listen", f"{front.listen[0]} is not a loopback address; set front.expose: true to serve "
                                  f"the front door beyond this machine (got {listen_address(front.listen)!r})")
    return front


def listen_address(listen: tuple[str, int]) -> str:
    """A `listen` pair as HOST:PORT, an IPv6 host in brackets."""
    host, port = listen
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


SHIM_MODES = ("auto", "required", "off")
KERNEL_MODES = ("auto", "off")
STACK_SOURCES = ("auto", "pyspy", "shim", "sample")
REQUEST_CAPTURE = ("metadata", "bodies")


def _capture(sec: _Section, base: Path) -> CaptureConfig:
    cap = CaptureConfig(**sec.take_present({
        "dir": _path(base),
        "snapshots": _positive_int,
        "spacing": _positive_duration,
        "ceiling": _positive_duration,
        "sudo": _bool,
        "log_tail_lines": _positive_int,
        "keep": _positive_int,
        "max_bytes": _size,
        "keep_days": _positive_int,
        "min_free_bytes": _size,
        "stacks": _choice(STACK_SOURCES),
        "redact": _bool,
        "requests": _choice(REQUEST_CAPTURE),
    }))
    sec.done()
    return cap


def _listen(value: Any) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPV6]:PORT`` or a bare port (then 127.0.0.1). Hosts are IP literals or
    ``localhost``: a name would need DNS to know whether it is loopback."""
    form = "must be PORT, HOST:PORT or [IPV6]:PORT with an IP address or localhost, such as 127.0.0.1:9464"
    if isinstance(value, int) and not isinstance(value, bool):
        host, port_text = "127.0.0.1", str(value)
    elif isinstance(value, str) and (match := re.fullmatch(r"\s*(?:\[([0-9A-Fa-f:.]+)\]|([^\s:\[\]]+)):([0-9]{1,5})\s*", value)):
        host, port_text = match.group(1) or match.group(2), match.group(3)
    elif isinstance(value, str) and re.fullmatch(r"\s*[0-9]{1,5}\s*", value):
        host, port_text = "127.0.0.1", value.strip()
    else:
        raise ValueError(form)
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError("port must be 1 to 65535")
    if host.lower() == "localhost":
        return "127.0.0.1", port
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(form) from None
    return str(ip), port


def _textfile(base: Path) -> Callable[[Any], Path]:
    read_path = _path(base)

    def read(value: Any) -> Path:
        path = read_path(value)
        if path.suffix != ".prom":
            raise ValueError("must end in .prom (node_exporter's textfile collector reads only *.prom files)")
        return path

    return read


def _metrics(sec: _Section, base: Path) -> MetricsConfig:
    metrics = MetricsConfig(**sec.take_present({"listen": _listen, "textfile": _textfile(base), "expose": _bool}))
    sec.done()
    if metrics.listen is not None and not metrics.expose and not ipaddress.ip_address(metrics.listen[0]).is_loopback:
        raise sec.error("listen", f"{metrics.listen[0]} is not a loopback address; set metrics.expose: true to "
                                  f"serve metrics beyond this machine (got {listen_address(metrics.listen)!r})")
    return metrics
