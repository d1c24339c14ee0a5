"""The `metrics` config section: defaults, accepted forms, and one exact line for each bad input."""

from __future__ import annotations

import pytest

from mlxwatch.config import MetricsConfig, load_config
from mlxwatch.errors import ConfigError


def test_metrics_are_off_by_default(config_file):
    cfg = load_config(config_file("instances: []"))
    assert cfg.metrics == MetricsConfig() and not cfg.metrics.enabled


@pytest.mark.parametrize("text, listen", [
    ("metrics: {listen: '127.0.0.1:9464'}", ("127.0.0.1", 9464)),
    ("metrics: {listen: 9464}", ("127.0.0.1", 9464)),  # a bare port is loopback
    ("metrics: {listen: '9464'}", ("127.0.0.1", 9464)),
    ("metrics: {listen: 'localhost:9464'}", ("127.0.0.1", 9464)),
    ("metrics: {listen: '[::1]:9464'}", ("::1", 9464)),
    ("metrics: {listen: '127.0.0.2:9464'}", ("127.0.0.2", 9464)),  # all of 127/8 is loopback
    ("metrics: {listen: '0.0.0.0:9464', expose: true}", ("0.0.0.0", 9464)),
    ("metrics: {listen: '[::]:9464', expose: true}", ("::", 9464)),
])
def test_listen_forms(config_file, text, listen):
    assert load_config(config_file(text)).metrics.listen == listen


def test_textfile_is_relative_to_the_config_file(config_file):
    path = config_file("metrics: {textfile: node/mlxwatch.prom}")
    cfg = load_config(path)
    assert cfg.metrics.textfile == path.parent / "node/mlxwatch.prom" and cfg.metrics.enabled
    assert cfg.metrics.listen is None


BAD = [
    ("metrics: {listen: '0.0.0.0:9464'}",
     "metrics.listen: 0.0.0.0 is not a loopback address; set metrics.expose: true to serve metrics beyond this "
     "machine (got '0.0.0.0:9464')"),
    ("metrics: {listen: '[::]:9464'}",
     "metrics.listen: :: is not a loopback address; set metrics.expose: true to serve metrics beyond this "
     "machine (got '[::]:9464')"),
    ("metrics: {listen: '192.168.1.5:9464'}",
     "metrics.listen: 192.168.1.5 is not a loopback address; set metrics.expose: true to serve metrics beyond "
     "this machine (got '192.168.1.5:9464')"),
    ("metrics: {listen: 'mac-studio.local:9464'}",
     "metrics.listen: must be PORT, HOST:PORT or [IPV6]:PORT with an IP address or localhost, such as "
     "127.0.0.1:9464 (got 'mac-studio.local:9464')"),
    ("metrics: {listen: 'http://127.0.0.1:9464/metrics'}",
     "metrics.listen: must be PORT, HOST:PORT or [IPV6]:PORT with an IP address or localhost, such as "
     "127.0.0.1:9464 (got 'http://127.0.0.1:9464/metrics')"),
    ("metrics: {listen: '127.0.0.1:70000'}", "metrics.listen: port must be 1 to 65535 (got '127.0.0.1:70000')"),
    ("metrics: {listen: 0}", "metrics.listen: port must be 1 to 65535 (got 0)"),
    ("metrics: {listen: true}",
     "metrics.listen: must be PORT, HOST:PORT or [IPV6]:PORT with an IP address or localhost, such as "
     "127.0.0.1:9464 "
     "(got true: YAML reads a bare on, off, yes or no as true or false)"),
    ("metrics: {textfile: /var/node/mlxwatch.txt}",
     "metrics.textfile: must end in .prom (node_exporter's textfile collector reads only *.prom files) "
     "(got '/var/node/mlxwatch.txt')"),
    ("metrics: {textfile: ''}", "metrics.textfile: must be a non-empty string (got '')"),
    ("metrics: {expose: yes please}", "metrics.expose: must be true or false (got 'yes please')"),
    ("metrics: {port: 9464}", "metrics.port: unknown key (got 9464)"),
    ("metrics: [127.0.0.1:9464]", "metrics: must be a mapping (got ['127.0.0.1:9464'])"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_metrics_section_is_one_line_naming_the_key(config_file, text, message):
    path = config_file(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {message}"
    assert "\n" not in str(info.value)
