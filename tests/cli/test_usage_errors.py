"""A mistyped command line is one line on stderr, like every other refusal: what is wrong and
where the help is, without the full usage of the subcommand above it."""

import pytest

from localclip.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["train", "ptb-small", "--workers", "0"], "--workers value: 0"),
    (["train", "ptb-small", "--wrokers", "4"], "--wrokers"),
    (["train"], "recipe"),
    (["train", "ptb-small", "--compression", "int3"], "int3"),
    (["nosuch"], "nosuch"),
    (["data", "download"], "required"),
])
def test_a_usage_error_is_one_line_naming_the_value_and_the_help(capsys, argv, needle):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("localclip") and "error:" in lines[0] and needle in lines[0] and "--help" in lines[0], lines[0]
    assert captured.out == ""
