"""How a command stops on Ctrl+C (SIGINT) or SIGTERM: it cleans up, prints one line, and exits with code 130.

The one line, on stderr, is the stop line::

    gossiploco COMMAND: stopped (SIGNAL)[; DETAIL]

e.g. ``gossiploco dht: stopped (SIGTERM)`` or ``gossiploco swarm: stopped (SIGINT); the peers stopped; what
they wrote is in runs/swarm/ (summary.json)``. No traceback, nothing at ERROR. Exit code 130 (128 + SIGINT,
the shell's "stopped by Ctrl+C") for both signals: a stop asked for is an orderly end either way.

``stops_cleanly(command)`` wraps a command (under ``@app.command()``). It installs ``stop_on_signals()`` first,
so that SIGINT and SIGTERM both raise ``Stopped``, a ``KeyboardInterrupt``, in the main thread: every
``except KeyboardInterrupt`` cleanup path (a peer leaving the run, the swarm stopping its peers, a checkpoint
written) runs for both. An interrupt that ends the command, or ``typer.Exit(130)`` raised after its cleanup,
becomes the stop line and exit 130. A command whose cleanup has something to tell (where its output went, how
to continue) calls ``exit_stopped(command, detail)`` itself. A second signal during the cleanup interrupts it
(an impatient user's second Ctrl+C) and still ends in the stop line; once the line is printed the signals take
their default action (the process is only exiting then).

Processes a command starts are stopped by the command, never by the same signal behind its back (a terminal
sends Ctrl+C to the whole foreground process group): hivemind's DHT process and its p2pd run in a process group
of their own (``gossiploco.membership.lifeline``), and the peers ``gossiploco swarm`` starts in sessions of their
own (``gossiploco.runtime.launch``).
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

STOP_EXIT_CODE = 130
"""The exit code of a command stopped by SIGINT or SIGTERM."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_received: list[int] = []  # the stopping signals received by this process, in order

F = TypeVar("F", bound=Callable[..., Any])


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM once ``stop_on_signals`` is installed; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    _received.append(signum)
    raise Stopped(signum)


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM raise ``Stopped`` in the main thread (also where SIGINT was inherited
    ignored: launchers stop their peers with SIGINT). Call from the main thread."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)


def stop_line(command: str | None, detail: str | None = None) -> str:
    """The one line a stopped command prints: ``gossiploco COMMAND: stopped (SIGNAL)[; DETAIL]`` (``gossiploco:
    stopped (SIGNAL)`` before a command is known); the signal is the first one received (SIGINT when none was: a
    ``KeyboardInterrupt`` from elsewhere)."""
    name = signal.Signals(_received[0]).name if _received else "SIGINT"
    return f"gossiploco{f' {command}' if command else ''}: stopped ({name})" + (f"; {detail}" if detail else "")


def exit_stopped(command: str | None, detail: str | None = None) -> NoReturn:
    """Print the stop line and exit with ``STOP_EXIT_CODE``; call once the command's cleanup is done."""
    for signum in STOP_SIGNALS:  # only exiting is left: a further signal needs no traceback
        signal.signal(signum, signal.SIG_DFL)
    print(stop_line(command, detail), file=sys.stderr, flush=True)
    forget_handled_interrupt()
    raise SystemExit(STOP_EXIT_CODE)


def forget_handled_interrupt() -> None:
    """Clear CPython's "a KeyboardInterrupt went unhandled" flag, which a KeyboardInterrupt escaping code that a C
    extension ran sets and never clears, and which at exit makes the process kill itself with SIGINT (exit status
    -2, not 130); nothing on interpreters without it."""
    import ctypes

    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ValueError, AttributeError, OSError):
        pass


def stops_cleanly(command: str) -> Callable[[F], F]:
    """Decorate the function of ``gossiploco COMMAND`` (under ``@app.command()``): see the module docstring."""
    from click.exceptions import Exit

    def decorate(function: F) -> F:
        @functools.wraps(function)  # typer reads the options from the wrapped function's signature
        def run(*args: Any, **kwargs: Any) -> Any:
            stop_on_signals()
            try:
                return function(*args, **kwargs)
            except KeyboardInterrupt:
                pass
            except Exit as exc:  # the command's own exit after its cleanup
                if exc.exit_code != STOP_EXIT_CODE:
                    raise
            exit_stopped(command)

        return run  # type: ignore[return-value]

    return decorate
