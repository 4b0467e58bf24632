"""The garbage collector around a command's start-up and its exit.

Start-up makes about 340,000 objects (importing torch, the compiler modules its first optimizer pulls in,
hivemind; building the model and the data) and next to no cyclic garbage, yet the collector walks the growing heap
again and again while they are made: a peer's imports and first optimizer took 2.7-2.9 s of CPU, 2.1-2.2 s with
the collector off meanwhile (this 2-core machine). And at exit the interpreter's last collection walks whatever is
left: a peer took 2.2-2.8 s to exit after writing its summary, 0.2-0.4 s with everything frozen first (a native
profile showed ``gc_collect_main`` all along).

* ``pause``: a command that trains (``simulate``, ``peer``) turns the collector off as it starts;
* ``resume``: its start-up is over (``RunLifecycle.start``), or the command ended before that, however it ended
  (``stopping.stops_cleanly``): what start-up made is frozen (``gc.freeze``: never walked again, which makes the
  run's own full collections cheaper too) and the collector is on again, for the run;
* ``exiting``: the CLI returns (``gossiploco.__main__``): everything left is frozen, so the shutdown's last
  collection does not walk it. What must be written is written before by the code that opened it (files are
  closed, atexit handlers still run: logging's flush, multiprocessing's children), and objects freed by their
  reference counts still are; only cyclic garbage left at exit is not collected, which CPython never promises to.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """A command's start-up begins: no collections until ``resume``."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Start-up is over: freeze what it made and collect again (idempotent; nothing when ``pause`` did nothing)."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def exiting() -> None:
    """The process is about to exit: freeze everything left (module docstring)."""
    gc.freeze()
