"""The `gateeng` command line, without a model."""
import pytest

from gateeng.tools import cli

ENGINE = cli.engine_options()


def test_given_finds_the_engine_options_a_command_line_sets():
    argv = ["Hello", "--verified", "--margin", "0.5", "--kv-blocks=8", "--no-cpu-kernels", "--server", "h:1"]
    assert cli.given_options(argv, ENGINE) == ["margin_threshold", "kv_blocks", "no_cpu_kernels"]
    # A value equal to this command's default still counts: the server's default may differ.
    assert cli.given_options(["Hello", "--plan", "fast", "--max-window", "32"], ENGINE) == ["plan", "max_window"]
    assert cli.given_options(["Hello", "--max-tokens", "4"], ENGINE) == []


@pytest.mark.parametrize("extra, named", [(["--kv-blocks", "8"], "--kv-blocks"),
                                          (["--plan", "invariant"], "--plan"),
                                          (["--no-prefix-caching", "--threads", "1"], "--no-prefix-caching, --threads")])
def test_generate_against_a_server_refuses_options_that_only_a_local_engine_takes(extra, named, capsys):
    # Refused before any connection (nothing listens on port 1).
    assert cli.main(["generate", "--server", "127.0.0.1:1", "Hello", *extra]) == 2
    err = capsys.readouterr().err
    assert f"error: {named} set up a local engine" in err and "without --server" in err


def test_help_shows_no_none_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())   # the formatter wraps lines
    assert "(default: None)" not in out
    assert f"(default: {cli.DEFAULTS.margin_threshold})" in out
