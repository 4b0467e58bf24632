"""``python -m gossiploco``: the CLI. Ctrl+C while the CLI itself is still being imported (torch
takes seconds) exits like Ctrl+C anywhere else: code 130, no traceback.

SIGINT gets Python's usual handler even when this process inherited it *ignored* (a command
started in the background by a non-interactive shell, e.g. ``nohup ... &``, a service manager):
launchers (``gossiploco swarm``, the tests, the benches) stop peers with SIGINT so that they leave
gracefully, and an ignored SIGINT would leave them running until they are killed.

Exit code 130 is kept even when CPython would turn it into death by SIGINT (-2 for the parent):
when a KeyboardInterrupt escapes code that a C extension runs through ``PyRun_*`` (start-up code
hit by Ctrl+C), CPython sets its ``_Py_UnhandledKeyboardInterrupt`` flag, never clears it, and at
exit kills itself with SIGINT although the CLI caught the interrupt and exits 130 (measured: 8 of
40 peers interrupted 2.4 to 4 s into start-up). The flag is cleared after a handled interrupt.
"""

import signal
import sys

signal.signal(signal.SIGINT, signal.default_int_handler)


def _forget_handled_interrupt() -> None:
    """Clear CPython's "a KeyboardInterrupt went unhandled" flag (see the module docstring);
    nothing on interpreters without it."""
    import ctypes

    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ValueError, AttributeError, OSError):
        pass


try:
    from gossiploco.cli import app
except KeyboardInterrupt:
    _forget_handled_interrupt()
    sys.exit(130)

try:
    app()
except SystemExit as exc:
    if exc.code == 130:
        _forget_handled_interrupt()
    raise
