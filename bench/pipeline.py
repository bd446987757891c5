"""Throughput of the real pipeline under simulated engines, mode by mode (see asyncrl/benchmarks/pipeline.py).

OMP_NUM_THREADS=1 .venv/bin/python bench/pipeline.py [--modes sync,async-4] [overrides ...]
"""

import sys

from asyncrl.benchmarks.pipeline import main

if __name__ == "__main__":
    main(sys.argv[1:])
