"""Entry point of every component process: ``python -m asyncrl.fleet.child ROLE NAME RUN_DIR MODEL_DIR``.

The controller starts one of these per component; the role picks the loop to run (its entry in
``asyncrl.roles.ROLES``), imported here by its dotted path: each process imports only its own
role, and heavy libraries (vLLM, DeepSpeed) only inside the loops that use them.

Before anything else a component process starts its watches (``asyncrl.fleet.process_tree``): it ends its
process group when the controller that started it is gone, and every child it starts (vLLM's
engine core) ends the group when the component is gone. A child that ``multiprocessing`` spawns
(vLLM on a GPU) imports this module as ``__mp_main__``: its watch is armed at the end of this file.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
from collections.abc import Callable

from asyncrl.fleet import malloc_trim, process_tree
from asyncrl.fleet.context import ProcessContext, configure_process
from asyncrl.observability import heapwatch
from asyncrl.roles import ROLE_NAMES, Role, role
from asyncrl.wire.messages import ErrorEvent
from asyncrl.wire.sockets import flush_on_exit


def entry_function(r: Role) -> Callable[..., None]:
    """The main loop of role ``r``, imported from its dotted path ``module:function``."""
    module, _, function = r.entry.partition(":")
    return getattr(importlib.import_module(module), function)


def exit_now(code: int) -> None:
    """Exit once Python's own exit work is done (``atexit`` handlers, the log handlers, the
    standard streams), without the interpreter's teardown of every module and the libraries'
    static destructors: with vLLM, torch and DeepSpeed loaded that took 1-1.5 s per process
    here after the process had said its last word, and the run's stop waits on each stage's exit.
    Everything a component writes is closed before this (``ProcessContext.close``; sockets
    flushed by ``flush_on_exit``)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl.fleet.child")
    parser.add_argument("role", choices=ROLE_NAMES)
    parser.add_argument("name")
    parser.add_argument("run_dir")
    parser.add_argument("model_dir")
    args = parser.parse_args(argv)
    configure_process()
    heapwatch.start_from_env(args.name)  # off unless ASYNCRL_HEAPWATCH is set
    ctx = ProcessContext(args.role, args.name, args.run_dir)
    malloc_trim.start(args.name, ctx.cfg.run.malloc_trim_s)  # a daemon thread; ends with the process
    try:
        r = role(args.role)
        run = entry_function(r)
        if r.takes_model:
            run(ctx, args.model_dir)
        else:
            run(ctx)
    except Exception as e:
        logging.getLogger(args.name).exception("crashed")
        ctx.emit(ErrorEvent(error=f"{type(e).__name__}: {e}"))
        ctx.close()
        flush_on_exit()
        # Out at once: the interpreter's clean-up runs library destructors that can block on
        # what made us fail (a process group whose peer is gone or stopped).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    ctx.close()
    flush_on_exit()
    return 0


if __name__ == "__main__":
    process_tree.guard_component()  # here, not in main(): a test may call main() in its own process
    exit_now(main())
elif __name__ == "__mp_main__":  # a child multiprocessing spawned from a component (vLLM's engine core)
    process_tree.watch_parent()
    process_tree.arm_children()
