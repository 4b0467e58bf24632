"""``python -m gossiploco`` and the ``gossiploco`` console script (``main``): the CLI. Ctrl+C or SIGTERM while
the CLI itself is still being imported (torch takes seconds) stops it like a stop anywhere else
(``gossiploco.runtime.stopping``): the stop line, code 130, no traceback.

SIGINT gets a handler even when this process inherited it *ignored* (a command started in the background by
a non-interactive shell, e.g. ``nohup ... &``, a service manager): launchers (``gossiploco swarm``, the tests,
the benches) stop peers with SIGINT so that they leave gracefully, and an ignored SIGINT would leave them
running until they are killed.

Exit code 130 is kept even when CPython would turn it into death by SIGINT (-2 for the parent): when a
KeyboardInterrupt escapes code that a C extension runs through ``PyRun_*`` (start-up code hit by Ctrl+C),
CPython sets its ``_Py_UnhandledKeyboardInterrupt`` flag, never clears it, and at exit kills itself with
SIGINT although the CLI caught the interrupt and exits 130 (measured: 8 of 40 peers interrupted 2.4 to 4 s
into start-up). ``exit_stopped`` clears the flag, and so does this module after any exit with code 130.

Every object left at exit is frozen before the interpreter shuts down (``runtime.collector.exiting``), so its last
garbage collection does not walk them: a peer exits in 0.2-0.4 s after its run instead of 2.2-2.8 s.
"""

import sys

from gossiploco.runtime import collector
from gossiploco.runtime.stopping import STOP_EXIT_CODE, exit_stopped, forget_handled_interrupt, stop_on_signals


def main() -> None:
    """The ``gossiploco`` command (the console script), as ``python -m gossiploco`` runs it."""
    stop_on_signals()
    try:
        from gossiploco.cli import app
    except KeyboardInterrupt:
        exit_stopped(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else None)
    try:
        app()
    except SystemExit as exc:
        if exc.code == STOP_EXIT_CODE:
            forget_handled_interrupt()
        collector.exiting()  # the shutdown's last collection skips what is left
        raise


if __name__ == "__main__":
    main()
