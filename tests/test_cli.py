"""The CLI (issue 11): every flag documented with its default, choices from METHODS, --version,
and `veloxquant generate` as mlx_lm generate with a bundle: it streams, reports tok/s, peak
memory and resident KV bytes, and refuses to run fp16 silently or take --kv-bits."""

from __future__ import annotations

import argparse

import veloxquant
import pytest

from veloxquant.cli import build_parser, main
from veloxquant.methods import METHODS


def all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_every_flag_has_help_and_shows_its_default():
    for parser in all_parsers(build_parser()):
        assert isinstance(parser.formatter_class, type)
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), (
            parser.prog
        )
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{parser.prog}: {action.dest} has no help"
        parser.format_help()  # renders


def test_method_choices_come_from_methods(capsys):
    for verb in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = capsys.readouterr().out
        assert "{" + ",".join(METHODS) + "}" in out.replace("\n", "").replace(" ", "")
        assert "(default:" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip().endswith(veloxquant.__version__)


def test_unknown_flags_are_refused_except_for_serve(capsys):
    with pytest.raises(SystemExit):
        main(["bundle", "inspect", "x", "--port", "1"])
    assert "unrecognized arguments: --port 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def art(artifacts_root):
    return artifacts_root / "artifacts" / "smollm2-135m"


def test_generate_without_method_refuses_to_run_fp16_with_a_bundle(art, capsys):
    argv = ["generate", str(art / "model"), "-p", "hi", "--artifact-dir", str(art / "bundle")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "no --method" in err and "qfilters" in err and "vecinfer" in err


def test_generate_streams_and_reports(art, capsys):
    argv = [
        "generate",
        str(art / "model"),
        "--prompt",
        "What is the capital of France?",
        "--system-prompt",
        "Answer in one sentence.",
        "--method",
        "qfilters",
        "--artifact-dir",
        str(art / "bundle"),
        "--budget",
        "0.25",
        "--max-tokens",
        "12",
        "--seed",
        "0",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Paris" in out
    for line in ("Prompt: ", "Generation: ", "tokens-per-sec", "Peak memory: ", "KV cache: "):
        assert line in out
    assert "QFiltersCache x30" in out and "MB resident" in out


def test_generate_refuses_kv_bits_up_front(art, capsys):
    argv = ["generate", str(art / "model"), "-p", "hi", "--method", "knorm", "--budget", "64"]
    assert main([*argv, "--kv-bits", "4"]) == 1
    assert "kv_bits=4" in capsys.readouterr().err
