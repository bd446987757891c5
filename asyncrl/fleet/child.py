"""Entry point of every component process: ``python -m asyncrl.fleet.child ROLE NAME RUN_DIR MODEL_DIR``.

The controller starts one of these per component; the role picks the loop to run. Imports of
heavy libraries (vLLM, DeepSpeed) happen inside the loops, so each process loads only its own.
"""

from __future__ import annotations

import argparse
import logging
import sys

from asyncrl.fleet.context import ProcessContext, configure_process
from asyncrl.wire.sockets import flush_on_exit

ROLES = ("dispatcher", "generator", "reward", "buffer", "learner", "reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl.fleet.child")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("name")
    parser.add_argument("run_dir")
    parser.add_argument("model_dir")
    args = parser.parse_args(argv)
    configure_process()
    ctx = ProcessContext(args.role, args.name, args.run_dir)
    try:
        if args.role == "dispatcher":
            from asyncrl.dispatcher.process import run_dispatcher

            run_dispatcher(ctx, args.model_dir)
        elif args.role == "generator":
            from asyncrl.generators.multiplex import run_generator_process

            run_generator_process(ctx, args.model_dir)
        elif args.role == "reward":
            from asyncrl.rewards.process import run_reward_worker

            run_reward_worker(ctx, owner=True)
        elif args.role == "buffer":
            from asyncrl.buffer.process import run_buffer

            run_buffer(ctx)
        elif args.role == "learner":
            from asyncrl.learner.process import run_learner

            run_learner(ctx, args.model_dir)
        elif args.role == "reference":
            from asyncrl.learner.reference import run_reference

            run_reference(ctx, args.model_dir)
    except Exception as e:
        logging.getLogger(args.name).exception("crashed")
        ctx.emit("error", error=f"{type(e).__name__}: {e}")
        ctx.close()
        flush_on_exit()
        return 1
    ctx.close()
    flush_on_exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
