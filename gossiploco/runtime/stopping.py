"""How a command stops on Ctrl+C (SIGINT) or SIGTERM: it cleans up, prints one line, and exits with code 130.

The one line, on stderr, is the stop line::

    gossiploco COMMAND: stopped (SIGNAL)[; DETAIL]

e.g. ``gossiploco dht: stopped (SIGTERM)`` or ``gossiploco swarm: stopped (SIGINT); the peers stopped; what
they wrote is in runs/swarm/ (summary.json)``. No traceback, nothing at ERROR. Exit code 130 (128 + SIGINT,
the shell's "stopped by Ctrl+C") for both signals: a stop asked for is an orderly end either way.

``stops_cleanly(command)`` wraps a command (under ``@app.command()``). It installs ``stop_on_signals()`` first,
so that SIGINT and SIGTERM both raise ``Stopped``, a ``KeyboardInterrupt``, in the main thread: every
``except KeyboardInterrupt`` cleanup path (a peer leaving the run, the swarm stopping its peers, a checkpoint
written) runs for both; one that comes while a module is being imported is raised once the import is done
(``_raise_stopped``). An interrupt that ends the command, or ``typer.Exit(130)`` raised after its cleanup,
becomes the stop line and exit 130; so does any other exception once a stopping signal came (code cut short
may fail in its own way: a consequence of the stop, logged at DEBUG). A command whose cleanup has something
to tell (where its output went, how to continue) calls ``exit_stopped(command, detail)`` itself. A second
signal during the cleanup interrupts it (an impatient user's second Ctrl+C) and still ends in the stop line;
once the line is printed the signals take their default action (the process is only exiting then).

A stop can be swallowed: a signal whose handler runs while the main thread is in a finalizer (``__del__``, a
weakref callback, the garbage collector's) raises ``Stopped`` where Python cannot raise anything, so the
interpreter prints "Exception ignored" and goes on, and the run would train on until killed. Training loops call
``raise_if_stopped()`` at each step: a stop received but not raised is raised there, and the unraisable-exception
hook that ``stop_on_signals`` installs says so at DEBUG instead of printing the swallowed interrupt's traceback.

Processes a command starts are stopped by the command, never by the same signal behind its back (a terminal
sends Ctrl+C to the whole foreground process group): hivemind's DHT process and its p2pd run in a process group
of their own (``gossiploco.membership.lifeline``), and the peers ``gossiploco swarm`` starts in sessions of their
own (``gossiploco.runtime.launch``).
"""

from __future__ import annotations

import _thread
import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn, TypeVar

from gossiploco.runtime import collector

log = logging.getLogger(__name__)

STOP_EXIT_CODE = 130
"""The exit code of a command stopped by SIGINT or SIGTERM."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

IMPORT_RETRY_S = 0.05
"""How often a stop that landed inside an import is tried again (``_raise_stopped``)."""

_received: list[int] = []  # the stopping signals received by this process, in order
_deferred: int | None = None  # a stop that landed inside an import, raised once the import is done
_retry: threading.Timer | None = None

F = TypeVar("F", bound=Callable[..., Any])


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM once ``stop_on_signals`` is installed; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    """The handler of SIGINT and SIGTERM: raise ``Stopped``, unless a module is being imported. An exception cut
    into an import leaves the module half-initialised (the next import fails with an ``AttributeError``) or, in
    torch's, escapes through C++ that aborts the process; so the stop waits until the import is done, tried again
    every ``IMPORT_RETRY_S`` (``_thread.interrupt_main``, which calls this handler again)."""
    global _deferred, _retry
    if _deferred is None:
        _received.append(signum)
    if _inside_import(frame):
        _deferred = _deferred if _deferred is not None else signum
        if _retry is None:
            _retry = threading.Timer(IMPORT_RETRY_S, _retry_stop, (_deferred,))
            _retry.daemon = True
            _retry.start()
        return
    signum = _deferred if _deferred is not None else signum
    _deferred = None
    raise Stopped(signum)


def _retry_stop(signum: int) -> None:
    global _retry
    _retry = None
    _thread.interrupt_main(signum)  # nothing once the handler is SIG_DFL again (``exit_stopped``)


def _inside_import(frame: FrameType | None) -> bool:
    """Whether ``frame`` (where the main thread was when the signal came) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib."):
            return True
        frame = frame.f_back
    return False


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM raise ``Stopped`` in the main thread (also where SIGINT was inherited
    ignored: launchers stop their peers with SIGINT). Call from the main thread."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    if sys.unraisablehook is not _quiet_swallowed_stop:
        global _unraisable_before
        _unraisable_before = sys.unraisablehook
        sys.unraisablehook = _quiet_swallowed_stop


_unraisable_before: Callable[[Any], None] = sys.__unraisablehook__


def _quiet_swallowed_stop(unraisable: Any) -> None:
    """A ``Stopped`` raised where it could not be (a finalizer): noted at DEBUG, raised again by the next
    ``raise_if_stopped``; any other unraisable exception goes to the hook that was there before."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, Stopped):
        log.debug("a stop landed in %r, which cannot raise it: the run stops at its next step", unraisable.object)
        return
    _unraisable_before(unraisable)


def raise_if_stopped() -> None:
    """Raise ``Stopped`` if a stopping signal came and was never raised (module docstring: a stop can be swallowed);
    training loops call it at each step. Nothing while a stop waits for an import to end (it is raised then), nor
    once the stop line is printed or where ``stop_on_signals`` is not in force (a test's process)."""
    if _received and _deferred is None and signal.getsignal(signal.SIGINT) is _raise_stopped:
        log.debug("a %s came and was not raised (swallowed by a finalizer): raised now",
                  signal.Signals(_received[0]).name)
        raise Stopped(_received[0])


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
            except Exception:
                if not _received:
                    raise
                # Stopped inside code that does not expect it (a library's import cut short fails later in its
                # own way): the user asked for the stop, this is how it went
                log.debug("gossiploco %s: failed after %s", command, signal.Signals(_received[0]).name, exc_info=True)
            finally:
                collector.resume()  # a start-up that paused it and never got to its run (``runtime.collector``)
            exit_stopped(command)

        return run  # type: ignore[return-value]

    return decorate
