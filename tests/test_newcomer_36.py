"""What a newcomer tripped on in issue 36's round, each measured on main before its fix:
contradicting flags that let the last one win, a status that could not read its state dir
without a fix, a typo'd key never named, missing-config lines without `run`'s hint, long paths
indented past 80 columns, and a non-mlx server on an instance's port taken for a crashed one."""

from __future__ import annotations

import io
import tarfile

import pytest
from rich.console import Console
from test_cli import make_bundle, no_user_config, one_line_error  # noqa: F401 - no_user_config: autouse fixture

import mlxwatch.cli as cli


# --- contradicting flags: refused, exit 2, one line (the last one won)


def test_export_with_redact_and_no_redact_is_refused(tmp_path, capsys):
    """Measured: `bundle export X --redact --no-redact` exited 0 and wrote an unredacted archive."""
    bundle = make_bundle(tmp_path / "bundles")
    for flags in (["--redact", "--no-redact"], ["--no-redact", "--redact"]):
        argv = ["bundle", "export", str(bundle), *flags, "--out", str(tmp_path / "out")]
        code = cli.run(argv, out=Console(file=io.StringIO()))
        line = one_line_error(capsys, code, argv, 2, "contradict")
        assert "--redact" in line and "--no-redact" in line
    assert not (tmp_path / "out").exists() and not list(tmp_path.rglob("*.tar.gz"))
    # the same form twice is still one wish
    argv = ["bundle", "export", str(bundle), "--redact", "--redact", "--out", str(tmp_path / "out")]
    assert cli.run(argv, out=Console(file=io.StringIO())) == 0
    (archive,) = (tmp_path / "out").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        assert any(m.name.endswith("manifest.json") for m in tar.getmembers())


def test_config_init_with_out_and_print_is_refused(tmp_path, capsys):
    """Found looking for other such pairs: `config init --out FILE --print` went on to print
    (--print wins) and ignored --out without a word."""
    argv = ["config", "init", "--out", str(tmp_path / "c.yaml"), "--print"]
    code = cli.run(argv, out=Console(file=io.StringIO()))
    one_line_error(capsys, code, argv, 2, "--out and --print")
    assert not (tmp_path / "c.yaml").exists()

