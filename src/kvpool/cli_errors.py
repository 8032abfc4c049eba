"""How every ``kvpool`` command fails: one line, ``kvpool: <ErrorType>: <what and what to do>``.

Exit status 2 for usage errors (bad options, :class:`~kvpool.errors.InvalidArgument`), 1 for
runtime errors, 130 on Ctrl-C. ``--debug`` (anywhere on the command line) or ``KVPOOL_DEBUG=1``
shows the traceback instead; children started by the command inherit it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from kvpool import errors
from kvpool.errors import InvalidArgument

__all__ = [
    "UsageError",
    "CliParser",
    "host_port_arg",
    "number_arg",
    "port_arg",
    "debug_enabled",
    "error_line",
    "exit_code",
    "run_main",
]


class UsageError(InvalidArgument):
    """The command line is malformed (unknown option, missing or unreadable value): see ``--help``."""


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` (one line, exit 2) instead of
    printing the usage block; defaults are shown in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        # Our own type= parsers raise InvalidArgument with the option named; keep their message.
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as exc:
            cause = exc.__context__
            if isinstance(cause, InvalidArgument):
                raise cause from None
            raise


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples in descriptions/epilogs as written; appends ``(default: X)`` where an
    option's help does not already name its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "%(default)" not in text
            and "default" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def host_port_arg(option: str) -> Callable[[str], str]:
    """An argparse ``type=`` for ``host:port`` (port 1-65535) that names ``option`` in its error."""

    def parse(text: str) -> str:
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{option} {text!r} is not host:port (e.g. 127.0.0.1:50051)")
        return text

    parse.__name__ = "address"
    return parse


def number_arg(
    option: str, kind: type = int, *, minimum: float | None = None, maximum: float | None = None
) -> Callable[[str], Any]:
    """An argparse ``type=`` for an int or float that must be more than 0 (``minimum=None``) or at
    least ``minimum`` (and at most ``maximum``); its error names ``option``."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise UsageError(f"{option} must be {what}, got {text!r}") from None
        if v != v or (v <= 0 if minimum is None else v < minimum):  # (NaN is refused too)
            bound = "more than 0" if minimum is None else f"at least {minimum}"
            raise UsageError(f"{option} must be {bound}, got {text}")
        if maximum is not None and v > maximum:
            raise UsageError(f"{option} must be at most {maximum}, got {text}")
        return v

    parse.__name__ = kind.__name__
    return parse


def port_arg(option: str) -> Callable[[str], int]:
    """An argparse ``type=`` for a TCP port, 0 (any free port) to 65535."""
    return number_arg(option, int, minimum=0, maximum=65535)


def debug_enabled(argv: list[str] | None = None) -> bool:
    """``--debug`` in ``argv`` or ``KVPOOL_DEBUG`` set to something true."""
    if argv is not None and "--debug" in argv:
        return True
    return os.environ.get("KVPOOL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def exit_code(exc: BaseException) -> int:
    """2 for usage errors, 130 for Ctrl-C, 1 otherwise."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 2 if isinstance(exc, InvalidArgument) else 1


def error_line(exc: BaseException) -> str:
    """``kvpool: <ErrorType>: <message>`` on one line."""
    name = type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        msg = f"{exc.strerror}{where}"
        if isinstance(exc, FileNotFoundError):
            msg += "; check the path"
        elif getattr(exc, "errno", None) == 98:  # EADDRINUSE
            msg += "; pick another --port or stop what is using it"
        elif isinstance(exc, PermissionError):
            msg += "; check the permissions (or run as a user who may)"
    elif isinstance(exc, errors.KvpoolError) or isinstance(exc, (ValueError, TimeoutError)):
        msg = str(exc)
    else:
        msg = f"{exc} (unexpected; rerun with --debug for the traceback and report it)"
    msg = " ".join(msg.split()) or "(no message)"
    return f"kvpool: {name}: {msg}"


def run_main(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Call ``main(argv)`` (``--debug`` removed), turning any exception into one line on stderr and
    the exit status; with debug the traceback is printed as Python would."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        os.environ["KVPOOL_DEBUG"] = "1"  # children started by this command inherit it
        argv = [a for a in argv if a != "--debug"]
    try:
        return int(main(argv) or 0)
    except SystemExit as exc:  # argparse --help, or a main that exits itself
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kvpool ... | head`: the reader left; nothing to report
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 141
    except Exception as exc:  # noqa: BLE001 - this is the one place errors become exit codes
        if debug_enabled():
            raise
        print(error_line(exc), file=sys.stderr, flush=True)
        return exit_code(exc)
