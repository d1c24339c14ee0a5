"""``mlxwatch launch``'s own flags, refused as every command's are: one line naming the value.
Found by trying them: ``--record-max-age -5s`` said only "expected one argument" (the word
``launch`` ended the attaching of negative values, meant for the server's command after
``--``); ``--record-max-bytes 1048576`` (bytes, as the config takes them) was "must be a
positive size"; the bounds without ``--record`` were dropped without a word (nothing recorded)."""

from __future__ import annotations

import pytest

from mlxwatch.cli.parser import build_parser, parse
from mlxwatch.cli.app import run
from mlxwatch.config import parse_size
from mlxwatch.errors import UsageError


@pytest.mark.parametrize("flag, value, says", [
    ("--record-max-age", "-5s", "must be a duration such as 30, 30s, 5m or 1h (got '-5s')"),
    ("--record-max-bytes", "-1", "must be a positive size such as 500MB or 2GB (got '-1')"),
    ("--record-max-bytes", "-1MiB", "must be a positive size such as 500MB or 2GB (got '-1MiB')"),
])
def test_a_negative_bound_is_named(flag, value, says):
    with pytest.raises(UsageError, match=f"{flag}: {says}".replace("(", r"\(").replace(")", r"\)")):
        parse(build_parser(), ["launch", "--record", flag, value, "--", "mlx_lm.server", "--port", "-1"])


def test_the_servers_command_is_left_as_it_is():
    args = parse(build_parser(), ["launch", "--name", "big", "--record", "--", "srv", "--timeout", "-5s"])
    assert args.server_command[-3:] == ["srv", "--timeout", "-5s"] and args.name == "big"


def test_a_size_in_bytes_is_a_size():
    assert parse_size("1048576") == parse_size(1048576) == 1024**2
    args = parse(build_parser(), ["launch", "--record", "--record-max-bytes", "1048576", "--", "mlx_lm.server"])
    assert args.record_max_bytes == 1024**2
    for bad in ("1.5", "0", "-3", "1e6", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("flags", [["--record-max-age", "5m"], ["--record-max-bytes", "64MiB"]])
def test_a_bound_without_record_is_refused(flags, capsys):
    code = run(["launch", *flags, "--", "/nonexistent/mlx_lm.server"])  # never exec the test
    err = capsys.readouterr().err
    assert code == 2 and "bounds --record" in err and len(err.strip().splitlines()) == 1, err
