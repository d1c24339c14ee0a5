"""The front door's config: ``instances[].front`` (off when absent), its defaults, and one line per bad value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mlxwatch.config import CaptureConfig, FrontConfig, load_config
from mlxwatch.errors import ConfigError

ROOT = Path(__file__).parent.parent


def _one(text: str, config_file) -> object:
    return load_config(config_file("instances:\n  - name: a\n    url: http://127.0.0.1:8080\n" + text)).instances[0]


def test_front_is_off_unless_configured(config_file):
    """No ``front`` section: no door; clients talk to the server as before. (An empty one asks
    for a door without an address: refused, below.)"""
    assert _one("", config_file).front is None


def test_front_defaults_come_from_the_dataclass(config_file):
    """Only ``listen`` set: every other setting is FrontConfig's default (one source of truth)."""
    inst = _one("    front: {listen: '127.0.0.1:9081'}\n", config_file)
    assert inst.front == FrontConfig(listen=("127.0.0.1", 9081))


def test_front_settings_are_read(config_file):
    inst = _one("    front: {listen: 9081, stall_timeout: 5s, request_stall_timeout: 2m, hold: 30s, replay: true,"
                " max_body: 1MiB, max_header: 8KiB, connect_ahead: false, max_buffered: 64MiB}\n", config_file)
    assert inst.front == FrontConfig(("127.0.0.1", 9081), False, 5.0, 120.0, 30.0, True, 1024**2, 8 * 1024, False,
                                     64 * 1024**2)


@pytest.mark.parametrize("front, key, message", [
    ("{}", "instances[0].front.listen", "is required"),
    # `front:` left with its keys commented out (YAML null): it validated, and no door was served
    ("", "instances[0].front.listen", "is required"),
    ("{listen: '0.0.0.0:9081'}", "instances[0].front.listen",
     "0.0.0.0 is not a loopback address; set front.expose: true to serve the front door beyond this machine "
     "(got '0.0.0.0:9081')"),
    ("{listen: '127.0.0.1:8080'}", "instances[0].front.listen",
     "is the server's own address; the front door needs a port of its own (got '127.0.0.1:8080')"),
    ("{listen: 9081, hold: -1}", "instances[0].front.hold", "must be 0 or a positive duration (got -1)"),
    ("{listen: 9081, stall_timeout: 0}", "instances[0].front.stall_timeout", "must be a positive duration (got 0)"),
    ("{listen: 9081, max_body: lots}", "instances[0].front.max_body",
     "must be a positive size such as 500MB or 2GB (got 'lots')"),
    ("{listen: 9081, replay: 1}", "instances[0].front.replay", "must be true or false (got 1)"),
    ("{listen: 9081, connect_ahead: 'no'}", "instances[0].front.connect_ahead", "must be true or false (got 'no')"),
    # replay waits up to hold for the recovered server: with hold 0 it silently never replayed
    ("{listen: 9081, replay: true}", "instances[0].front.replay",
     "needs front.hold above 0: a replayed request waits up to hold for the recovered server, so with hold 0 "
     "nothing would ever be replayed (got true)"),
    # a wildcard door takes the server's port on every address: it validated, then failed to bind
    ("{listen: '0.0.0.0:8080', expose: true}", "instances[0].front.listen",
     "is the server's own address; the front door needs a port of its own (got '0.0.0.0:8080')"),
    ("{listen: 9081, port: 1}", "instances[0].front.port", "unknown key (got 1)"),
])
def test_bad_front_values_are_one_line(config_file, front, key, message):
    path = config_file(f"instances:\n  - name: a\n    url: http://127.0.0.1:8080\n    front: {front}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: {key}: {message}"


def test_validate_says_which_instances_have_a_front_door(config_file, capsys):
    """Found in a walk through the README: `config validate` never said whether a door was on."""
    from mlxwatch.cli import run
    path = config_file("instances:\n  - name: a\n    url: http://127.0.0.1:8080\n    front: {listen: 9081}\n"
                       "  - name: b\n    url: http://127.0.0.1:8090\n")
    assert run(["config", "validate", str(path)]) == 0
    out = capsys.readouterr().out
    a, b = out.split("\n  a: ", 1)[1].split("\n  b: ", 1)  # each instance's lines
    assert a.endswith("\n    front door on 127.0.0.1:9081") and "front door" not in b, out


def test_a_front_door_may_listen_beyond_loopback_when_exposed(config_file):
    inst = _one("    front: {listen: '0.0.0.0:9081', expose: true}\n", config_file)
    assert inst.front.listen == ("0.0.0.0", 9081) and inst.front.expose


@pytest.mark.parametrize("text, key, where", [
    ("metrics: {listen: 9081}\ninstances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: 9081}}\n",
     "instances[0].front.listen", "metrics.listen"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: 9081}}\n"
     "  - {name: b, url: 'http://127.0.0.1:8082', front: {listen: 9081}}\n",
     "instances[1].front.listen", "instances[0].front.listen"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:8080'}\n"
     "  - {name: b, url: 'http://127.0.0.1:8082', front: {listen: 8080}}\n",
     "instances[1].front.listen", "instances[0].url"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: 8082}}\n"
     "  - {name: b, url: 'http://127.0.0.1:8082'}\n",
     "instances[1].url", "instances[0].front.listen"),
    # a wildcard door (expose: true) takes its port on every address: these validated, then failed to bind
    ("metrics: {listen: 9081}\ninstances:\n  - {name: a, url: 'http://127.0.0.1:8080', "
     "front: {listen: '0.0.0.0:9081', expose: true}}\n",
     "instances[0].front.listen", "metrics.listen"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: '[::1]:9081'}}\n"
     "  - {name: b, url: 'http://127.0.0.1:8082', front: {listen: '[::]:9081', expose: true}}\n",
     "instances[1].front.listen", "instances[0].front.listen"),
    ("metrics: {listen: '[::]:9081', expose: true}\ninstances:\n  - {name: a, url: 'http://127.0.0.1:8080', "
     "front: {listen: '0.0.0.0:9081', expose: true}}\n",
     "instances[0].front.listen", "metrics.listen"),  # the metrics' [::] is dual-stack
    ("instances:\n  - {name: a, url: 'http://localhost:8080'}\n"
     "  - {name: b, url: 'http://127.0.0.1:8082', front: {listen: '0.0.0.0:8080', expose: true}}\n",
     "instances[1].front.listen", "instances[0].url"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: '0.0.0.0:8082', expose: true}}\n"
     "  - {name: b, url: 'http://127.0.0.1:8082'}\n",
     "instances[1].url", "instances[0].front.listen"),
])
def test_a_front_door_address_is_its_own(config_file, text, key, where):
    """Two listeners on one port would fail at start, or send a client to the wrong server."""
    path = config_file(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: {key}: same address as {where}")


@pytest.mark.parametrize("text", [
    # a server URL naming another host may be another machine: same port number, no clash here
    "instances:\n  - {name: a, url: 'http://10.0.0.7:9081'}\n"
    "  - {name: b, url: 'http://127.0.0.1:8082', front: {listen: '0.0.0.0:9081', expose: true}}\n",
    # the door's [::] is IPv6 only (asyncio sets IPV6_V6ONLY) and 0.0.0.0 IPv4 only: both bind beside these
    "instances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: '[::]:8080', expose: true}}\n",
    "instances:\n  - {name: a, url: 'http://[::1]:8080', front: {listen: '0.0.0.0:8080', expose: true}}\n",
    "instances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: '0.0.0.0:9081', expose: true}}\n"
    "  - {name: b, url: 'http://127.0.0.1:8082', front: {listen: '[::1]:9081'}}\n",
    "instances:\n  - {name: a, url: 'http://127.0.0.1:8080', front: {listen: '[::]:9081', expose: true}}\n"
    "  - {name: b, url: 'http://127.0.0.1:8082', front: {listen: '127.0.0.1:9081'}}\n",
])
def test_a_wildcard_door_beside_addresses_it_does_not_take_validates(config_file, text):
    assert load_config(config_file(text)).instances


def test_capture_requests_setting(config_file):
    assert CaptureConfig().requests == "metadata"
    cfg = load_config(config_file("capture: {requests: bodies}\n"))
    assert cfg.capture.requests == "bodies"
    with pytest.raises(ConfigError, match=r"capture.requests: must be one of metadata, bodies \(got 'all'\)"):
        load_config(config_file("capture: {requests: all}\n"))


def test_example_front_block_is_the_defaults(tmp_path):
    """The example's commented-out front block, uncommented, loads as the dataclass defaults: the
    comments cannot drift from the code."""
    text = (ROOT / "mlxwatch.example.yaml").read_text()
    block = re.search(r"^    # front:\n((?:    #   .*\n)+)", text, re.M)
    assert block, "the example config has no commented front block"
    lines = ["    front:"] + ["    " + line[len("    # "):] for line in block.group(1).splitlines()]
    path = tmp_path / "c.yaml"
    path.write_text("instances:\n  - name: a\n    url: http://127.0.0.1:8080\n" + "\n".join(lines) + "\n")
    front = load_config(path).instances[0].front
    assert front == FrontConfig(listen=front.listen)
    requests = re.search(r"^  # requests: (\w+)", text, re.M)
    assert requests and requests.group(1) == CaptureConfig().requests
