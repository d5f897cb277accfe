"""The ``streampack`` command.

Each subcommand lives in its own module, which provides ``configure(parser)`` to add
its arguments and ``main(args) -> int`` to run. The table below is the one place that
names them; modules are imported only when their subcommand is built or run.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import InternalError, StreampackError
from .logs import add_logging_flags, setup_logging

# (name, module, one-line help). Add a subcommand by adding a row.
COMMANDS: list[tuple[str, str, str]] = [
    ("trace", "streampack.trace", "print the JSON trace of the worked example"),
    (
        "produce",
        "streampack.service.producer",
        "run the producer: cut windows, order batches, serve ranks",
    ),
    ("worker", "streampack.service.worker", "run a pack worker connected to a producer"),
    (
        "serve",
        "streampack.service.serve",
        "run the producer and N local pack workers under a supervisor",
    ),
    (
        "consume",
        "streampack.service.consume",
        "drain one rank's stream; print throughput and a digest",
    ),
    ("digest", "streampack.service.digest", "compute in process the digest `consume` prints"),
    (
        "health",
        "streampack.service.health",
        "ask a producer whether it is serving (exit 0) or not (1)",
    ),
    (
        "inspect",
        "streampack.service.inspect_batch",
        "picture one batch: cells by segment, permission matrix",
    ),
    (
        "corpus",
        "streampack.corpus.command",
        "build a token corpus from text (build, or in parts: build --shard and merge), "
        "compute its per-document table (digest), or report on one (inspect)",
    ),
    (
        "demo",
        "streampack.service.demo",
        "serve the bundled corpus to two ranks and verify exactly once",
    ),
]

# Flags whose value may begin with "-" (see _join_key_values).
KEY_FLAGS = ("--curve-server-key",)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only``, the full arguments of that one
    subcommand (the others listed by name and help): only its module is imported."""
    parser = argparse.ArgumentParser(
        prog="streampack",
        description="Streaming sequence packing with block-causal ranges.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.configure(sub)
            add_logging_flags(sub)
            sub.set_defaults(_module=module)
    return parser


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first argument that is not an option (the top
    level has no option that takes a value)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def _join_key_values(argv: list[str]) -> list[str]:
    """``--curve-server-key KEY`` as ``--curve-server-key=KEY``: a Z85 key may begin with
    ``-``, which argparse would otherwise take for an option."""
    joined: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token in KEY_FLAGS:
            token = f"{token}={next(tokens, '')}"
        joined.append(token)
    return joined


def _user_error_line(error: Exception) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.strerror or error}: {error.filename!r}"
    return str(error)


def main(argv: list[str] | None = None) -> int:
    argv = _join_key_values(sys.argv[1:] if argv is None else argv)
    # An unknown name builds no subcommand at all: argparse reports it with the list.
    command = chosen_command(argv)
    names = {name for name, _, _ in COMMANDS}
    args = build_parser(command if command in names else "").parse_args(argv)
    try:
        # Every process logs alike: its role is the subcommand (see streampack.logs).
        setup_logging(args.command, fmt=args.log_format, level=args.log_level)
        return int(args._module.main(args) or 0)
    except InternalError:
        raise  # a bug in streampack: the traceback is what its report needs
    except (StreampackError, OSError) as error:
        # A user mistake (bad flag value, missing corpus, unwritable path, ...): one line
        # that says what, not a traceback.
        print(f"streampack {args.command}: error: {_user_error_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
