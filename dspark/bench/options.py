"""Options of the `python -m dspark.bench.*` scripts (argparse stays in cli.py)."""

from __future__ import annotations


def parse_options(argv: list[str], defaults: dict[str, str], whole: tuple[str, ...] = ()) -> dict[str, str]:
    """`--name value` pairs over `defaults`. An unknown name, or a name of `whole` given
    anything but a whole number >= 1, stops with a message that names it (one of `whole` not
    given keeps its default, which may be empty: "not set")."""
    options, given = dict(defaults), set()
    args = iter(argv)
    for arg in args:
        if arg not in options:
            raise SystemExit(f"unknown option {arg}; the options are {', '.join(options)}")
        options[arg] = next(args, "")
        given.add(arg)
    for name in whole:
        value = options[name]
        if (name in given or value) and not (value.isdigit() and int(value) >= 1):
            raise SystemExit(f"{name} takes a whole number >= 1, got {value!r}")
    return options
