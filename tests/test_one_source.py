"""One source of truth: every default lives in the config dataclasses, and everything that states
a default (probe functions, CaptureRequest, the example config, docs/configuration.md, the
README and the docs' prose) says what the dataclasses say."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest
import yaml

from mlxwatch import config as cfgmod
from mlxwatch.capture.collector import CaptureRequest
from mlxwatch.config import (
    CaptureConfig,
    Config,
    FrontConfig,
    InstanceConfig,
    MemoryConfig,
    MetricsConfig,
    ProbeConfig,
    RestartConfig,
    parse_config,
)
from mlxwatch.durations import parse_duration
from mlxwatch.probes import probe_endpoint, probe_generation, run_check

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "mlxwatch.example.yaml"
CONFIG_DOC = ROOT / "docs" / "configuration.md"

# Dataclass fields that a file sets under another name. A restart's method is chosen by which
# key is present (``launchd: LABEL``); its target, argv and signal are that key's value.
FILE_KEYS: dict[tuple[type, str], tuple[str, ...]] = {
    (Config, "path"): (),  # where the file was read from, not a key in it
    (RestartConfig, "method"): ("launchd", "systemd", "command", "signal"),
    (RestartConfig, "target"): (),
    (RestartConfig, "argv"): (),
    (RestartConfig, "signal_name"): (),
}
# How docs/configuration.md names a field (instances' sections are written probe.X, restart.X).
DOC_NAMES: dict[tuple[type, str], str | None] = {
    (Config, "path"): None,
    (RestartConfig, "method"): "restart.<method>",
    (RestartConfig, "target"): None,  # the method key's value (Restart methods)
    (RestartConfig, "argv"): None,
    (RestartConfig, "signal_name"): None,
}
SECTION_DOC_PREFIX = {InstanceConfig: "instances[].", ProbeConfig: "probe.", RestartConfig: "restart.",
                      FrontConfig: "front.", MemoryConfig: "memory.", CaptureConfig: "capture.",
                      MetricsConfig: "metrics.", Config: ""}
# Fields the file must set although the dataclass has a default (a section that is present needs them).
REQUIRED_IN_FILE = {(FrontConfig, "listen")}


def _section_class(hint: typing.Any) -> type | None:
    """The config dataclass a field holds (itself, or the items of a tuple of it), else None."""
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _fields(cls: type) -> list[tuple[dataclasses.Field, typing.Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def dataclass_file_keys(cls: type = Config, prefix: str = "") -> set[str]:
    """Every key path a config file may set, walked from the dataclasses (``instances[].probe.timeout``)."""
    keys: set[str] = set()
    for f, hint in _fields(cls):
        names = FILE_KEYS.get((cls, f.name), (f.name,))
        section = _section_class(hint)
        for name in names:
            path = f"{prefix}{name}"
            if section is not None:
                keys |= dataclass_file_keys(section, f"{path}[]." if cls is Config and name == "instances"
                                            else f"{path}.")
            else:
                keys.add(path)
    return keys


def _default(f: dataclasses.Field) -> typing.Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def dataclass_doc_defaults(cls: type = Config) -> dict[str, typing.Any]:
    """docs/configuration.md's name for each plain field -> the dataclass default (MISSING: required)."""
    out: dict[str, typing.Any] = {}
    for f, hint in _fields(cls):
        section = _section_class(hint)
        if section is not None:
            out.update(dataclass_doc_defaults(section))
            continue
        name = DOC_NAMES.get((cls, f.name), SECTION_DOC_PREFIX[cls] + f.name)
        if name is not None:
            out[name] = dataclasses.MISSING if (cls, f.name) in REQUIRED_IN_FILE else _default(f)
    return out


# --- the example config

_COMMENTED_SETTING = re.compile(r"^(\s*)# (\s*(?:- )?[a-z_]+:(?:\s.*)?)$")


def _example_forms() -> tuple[str, str]:
    """The example as shipped, and with its optional settings (``# key: value`` lines) switched on."""
    text = EXAMPLE.read_text()
    return text, "\n".join(_COMMENTED_SETTING.sub(r"\1\2", line) for line in text.splitlines()) + "\n"


def _file_keys(data: typing.Any, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}{key}"
            keys.add(path)
            if key == "instances" and isinstance(value, list):
                for item in value:
                    keys |= _file_keys(item, f"{path}[].")
            else:
                keys |= _file_keys(value, f"{path}.")
    return keys


def _leaf_keys(keys: set[str]) -> set[str]:
    return {k for k in keys if not any(other.startswith((k + ".", k + "[].")) for other in keys)}


def test_example_config_validates_as_shipped_and_with_its_optional_settings_on():
    """Both forms of the example load; an optional setting shown commented out is a valid one."""
    for form in _example_forms():
        parse_config(yaml.safe_load(form), str(EXAMPLE), EXAMPLE)


def test_example_config_shows_every_key_the_dataclasses_have():
    """Every key a file may set appears in the example (set, or as a ``# key: value`` line), and
    the example sets no key the dataclasses do not have."""
    shown = _leaf_keys(_file_keys(yaml.safe_load(_example_forms()[1])))
    expected = dataclass_file_keys()
    assert sorted(expected - shown) == [], "keys the example config does not show"
    assert sorted(shown - expected) == [], "keys in the example config that no dataclass has"


# --- docs/configuration.md

def _doc_rows() -> dict[str, str]:
    """docs/configuration.md's table: key -> stated default, ``a`` / ``b`` cells split."""
    rows: dict[str, str] = {}
    for line in CONFIG_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = [n.strip().strip("`") for n in cells[0].split(" / ")]
        defaults = [d.strip() for d in cells[1].split(" / ")]
        assert len(names) == len(defaults), f"configuration.md row {cells[0]}: {len(names)} keys, {len(defaults)} defaults"
        section = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
        for name, default in zip(names, defaults, strict=True):
            rows[name if "." in name else section + name] = default
    return rows


_SIZE = re.compile(r"([0-9.]+)\s*(B|KB|MB|GB|KiB|MiB|GiB)")


def _stated_value(text: str) -> typing.Any:
    """What a docs default cell says, as a value to compare (None: no concrete value stated)."""
    text = text.strip("`").strip()
    if text in ("true", "false"):
        return text == "true"
    if match := _SIZE.fullmatch(text):
        return float(match.group(1)) * {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}[match.group(2).replace("i", "")]
    try:
        return parse_duration(text)
    except ValueError:
        return text


def test_configuration_doc_lists_every_key():
    """Every field a file may set has a row in docs/configuration.md, and every row is a field."""
    rows, fields = _doc_rows(), dataclass_doc_defaults()
    assert sorted(set(fields) - set(rows)) == [], "keys docs/configuration.md does not list"
    assert sorted(set(rows) - set(fields)) == [], "rows in docs/configuration.md that no dataclass has"


def test_configuration_doc_states_the_dataclass_defaults():
    """Each default in the table is the dataclass's: numbers, durations, sizes, booleans and
    choices exactly; ``required`` for a field without a default; words for no value."""
    rows, fields = _doc_rows(), dataclass_doc_defaults()
    wrong = []
    for name, default in fields.items():
        if name not in rows:
            continue
        stated = _stated_value(rows[name])
        if default is dataclasses.MISSING:
            ok = stated == "required"
        elif default is None or default == ():
            ok = isinstance(stated, str) and stated != "required"  # "none", "off", a description
        elif isinstance(default, bool):
            ok = stated is default
        elif isinstance(default, (int, float)):
            ok = not isinstance(stated, (str, bool)) and stated == default
        else:
            ok = stated == default
        if not ok:
            wrong.append(f"{name}: docs say {rows[name]!r}, the code {default!r}")
    assert wrong == []


# --- prose defaults in README.md and docs/*.md: "`interval` (30 s)", "`--timeout` (90s)"

_PROSE_DEFAULT = re.compile(r"`(--)?([a-z][a-z_.\-]*)`\s*\(([0-9][0-9.]*)\s*(ms|s|min|m|h|d|GB|MB)?\)")
_UNIT = {None: 1, "ms": 0.001, "s": 1, "min": 60, "m": 60, "h": 3600, "d": 86400, "GB": 1024**3, "MB": 1024**2}
_SECTIONS = {"probe": ProbeConfig, "restart": RestartConfig, "capture": CaptureConfig, "metrics": MetricsConfig,
             "front": FrontConfig, "memory": MemoryConfig}


def _numeric_defaults(classes: typing.Iterable[type], name: str) -> list[float]:
    return [f.default for cls in classes for f in dataclasses.fields(cls)
            if f.name == name and isinstance(f.default, (int, float)) and not isinstance(f.default, bool)]


def prose_defaults(text: str) -> list[tuple[str, float, list[float]]]:
    """(phrase, stated value, the defaults of the fields it may name) for each "`key` (value)"."""
    found = []
    for match in _PROSE_DEFAULT.finditer(text):
        flag, name, number, unit = match.groups()
        section, _, field_name = name.rpartition(".")
        if flag:  # check's and capture's flags stand for probe and capture settings
            classes, field_name = [ProbeConfig, CaptureConfig], name.replace("-", "_")
        elif section:
            if section.split(".")[-1] not in _SECTIONS:
                continue
            classes = [_SECTIONS[section.split(".")[-1]]]
        else:
            classes = list(_SECTIONS.values())
        candidates = _numeric_defaults(classes, field_name)
        if candidates:
            found.append((match.group(0), float(number) * _UNIT[unit], candidates))
    return found


def _prose_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_prose_default_phrases_are_read():
    """The check below reads the phrases the docs use (so it cannot pass by matching nothing)."""
    phrases = [p for f in _prose_files() for p, _, _ in prose_defaults(f.read_text())]
    assert "`interval` (30 s)" in phrases and "`--timeout` (90s)" in phrases and "`cooldown` (1 h)" in phrases
    assert prose_defaults("`interval` (31 s) and `--timeout` (1m)") == [
        ("`interval` (31 s)", 31.0, [30.0]), ("`--timeout` (1m)", 60.0, [90.0])]


def test_readme_and_docs_state_the_dataclass_defaults():
    """A default stated in prose, "`interval` (30 s)", is the dataclass's (a bare name that
    several sections have, such as ``timeout``, matches any of them)."""
    wrong = [f"{f.relative_to(ROOT)}: {phrase} but the code says {defaults}"
             for f in _prose_files() for phrase, stated, defaults in prose_defaults(f.read_text())
             if not any(abs(stated - d) < 1e-9 for d in defaults)]
    assert wrong == []


# --- code that takes a default takes the config's

@pytest.mark.parametrize("function, settings", [
    (probe_generation, {"first_token_timeout": "first_token_timeout", "timeout": "timeout", "max_tokens": "max_tokens"}),
    (run_check, {"first_token_timeout": "first_token_timeout", "timeout": "timeout", "max_tokens": "max_tokens",
                 "endpoint_timeout": "endpoint_timeout"}),
    (probe_endpoint, {"timeout": "endpoint_timeout"}),
])
def test_probe_function_defaults_are_the_probe_config(function, settings):
    """A probe called without a setting uses the config's default (or requires it)."""
    params = inspect.signature(function).parameters
    for param, field_name in settings.items():
        default = params[param].default
        assert default is inspect.Parameter.empty or default == getattr(ProbeConfig(), field_name), \
            f"{function.__name__}({param}={default}) but probe.{field_name} is {getattr(ProbeConfig(), field_name)}"


def test_capture_request_defaults_are_the_capture_config():
    """A CaptureRequest made without a setting captures as the config's defaults say."""
    request = CaptureRequest(pid=None, out_dir=Path("unused"))
    shared = {f.name for f in dataclasses.fields(CaptureConfig)} & {f.name for f in dataclasses.fields(CaptureRequest)}
    assert shared >= {"snapshots", "spacing", "ceiling", "sudo", "log_tail_lines", "keep", "max_bytes",
                      "keep_days", "min_free_bytes", "stacks", "redact"}
    for name in sorted(shared - {"dir"}):
        assert getattr(request, name) == getattr(CaptureConfig(), name), name


# --- each rule is said once

def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "mlxwatch").rglob("*.py"))}


def test_a_urls_port_is_computed_in_one_place():
    """``443 if https else 80`` is written once (config.url_port); everything else calls it."""
    places = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "mlxwatch").rglob("*.py"))
              if re.search(r"\b443\b", p.read_text())]
    assert places == ["mlxwatch/config.py"]
    assert cfgmod.url_port("https://h") == 443 and cfgmod.url_port("http://h") == 80
    assert cfgmod.url_port("http://127.0.0.1:8082/") == 8082


def test_state_and_bundle_dirs_are_decided_in_config():
    """The state dir and bundles dir are decided by config.state_dir_for / bundles_dir_for only."""
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "mlxwatch").rglob("*.py"))
                 if p.name != "config.py" and re.search(r'def (state_dir_for|bundles_dir_for|default_state_dir)\b'
                                                        r'|/ "bundles"', p.read_text())]
    assert offenders == []
    cfg = Config(state_dir=Path("/s"))
    assert cfgmod.state_dir_for(cfg) == Path("/s") and cfgmod.state_dir_for(cfg, Path("/o")) == Path("/o")
    assert cfgmod.bundles_dir_for(cfg, Path("/s")) == Path("/s/bundles")
    assert cfgmod.bundles_dir_for(Config(capture=CaptureConfig(dir=Path("/b"))), Path("/s")) == Path("/b")


def test_which_process_serves_an_instance_is_one_public_function():
    """doctor, the CLI and the watcher find an instance's server through host.process.lookup_instance;
    nobody repeats the launchd-label arguments or keeps a private copy (the CLI imported doctor's)."""
    sources = _package_sources()
    assert [p for p, text in sources.items() if "launchd_label=" in text and p != "mlxwatch/host/process.py"] == []
    assert [p for p, text in sources.items() if "_lookup_instance" in text] == []


def _definitions(name: str) -> list[str]:
    return [p for p, text in _package_sources().items() if re.search(rf"(?m)^{name}\s*=", text)]


def test_policy_numbers_and_messages_are_named_once():
    """The capture probe's caps, the first-probe spread and the duration message are each defined
    in one module, and no probe limit is capped by a bare number."""
    assert _definitions("PROBE_FIRST_TOKEN_CAP") == _definitions("PROBE_TIMEOUT_CAP") == ["mlxwatch/capture/collector.py"]
    assert len(_definitions("FIRST_PROBE_SPREAD")) == 1
    assert _definitions("_?DURATION_FORM") == ["mlxwatch/durations.py"]
    capped = [p for p, text in _package_sources().items()
              if re.search(r"min\([^()]*(timeout|interval), [0-9.]+\)", text)]
    assert capped == []


def test_the_journal_doc_names_every_event():
    """docs/journal.md says its list of event names is the ``Event`` enum; a new user found
    `backoff` missing from it."""
    from mlxwatch.journal.incidents import Event

    text = (ROOT / "docs" / "journal.md").read_text()
    missing = [e.value for e in Event if f"`{e.value}`" not in text]
    assert missing == []
