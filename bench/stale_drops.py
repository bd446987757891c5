"""Where a run's stale drops come from, read from its group ledger.

    .venv/bin/python bench/stale_drops.py RUN_DIR [--bin 20]

A group is dropped as ``stale`` either on arrival at the buffer (it was sampled by weights
already more than ``buffer.max_staleness`` versions behind the learner: the admission let it run
too far ahead, or a generator served old weights) or after waiting in the buffer (the sampler
passed it over until the learner moved past its bound). A group dispatched more than once is a
copy sent out again after a failure. Per time bin (seconds since the first ledger line) it
prints groups dispatched (and of those, again), trained and dropped as stale, split by
arrival / waited and copy / once; then the totals, and the staleness at the drop (learner
version minus the version that sampled the group), as JSON.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def learner_versions(lines: list[dict]) -> tuple[list[float], list[int]]:
    """(times, versions) of the learner's steps, in time order."""
    steps = [(ln["t"], int(ln["version"])) for ln in lines if ln["event"] == "trained"]
    return [t for t, _ in steps], [v for _, v in steps]


def version_at(times: list[float], versions: list[int], t: float) -> int:
    i = bisect.bisect_right(times, t) - 1
    return versions[i] if i >= 0 else 0


def stale_breakdown(lines: list[dict], bin_s: float) -> dict:
    """Counts per bin and in total (in groups); ``lines`` in time order."""
    times, versions = learner_versions(lines)
    t0 = lines[0]["t"] if lines else 0.0
    sent, sampled, inserted = Counter(), {}, {}
    bins: dict[int, Counter] = defaultdict(Counter)
    total, lag = Counter(), Counter()
    for ln in lines:
        event, groups, b = ln["event"], ln.get("groups", []), int((ln["t"] - t0) // bin_s)
        if event == "dispatched":
            sent.update(groups)
            bins[b]["dispatched"] += len(groups)
            bins[b]["again"] += sum(1 for g in groups if sent[g] > 1)
        elif event == "generated":
            sampled.update({g: (int(ln["version"]), ln["t"]) for g in groups})
        elif event == "inserted":
            inserted.update({g: ln["t"] for g in groups})
        elif event == "trained":
            bins[b]["trained"] += len(groups)
        elif event == "dropped" and ln.get("reason") == "stale":
            for g in groups:
                version, at = sampled.get(g, (None, ln["t"]))
                waited = inserted.get(g, -1.0) >= at  # inserted since it was last sampled
                kind = ("waited" if waited else "arrival") + ("_copy" if sent[g] > 1 else "_once")
                bins[b]["stale"] += 1
                bins[b][kind] += 1
                total[kind] += 1
                if version is not None:
                    lag[version_at(times, versions, ln["t"]) - version] += 1
    return {"bins": {b * bin_s: dict(c) for b, c in sorted(bins.items())}, "total": dict(total), "lag": dict(lag)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--bin", type=float, default=20.0, help="seconds per time bin")
    args = parser.parse_args(argv)
    from asyncrl.rundir.ledger import read_ledger

    report = stale_breakdown(read_ledger(args.run_dir), args.bin)
    for start, c in report["bins"].items():
        share = c.get("stale", 0) / max(1, c.get("stale", 0) + c.get("trained", 0))
        print(
            f"{start:6.0f}s dispatched {c.get('dispatched', 0):5d} (again {c.get('again', 0):4d})"
            f" trained {c.get('trained', 0):5d} stale {c.get('stale', 0):5d} ({share:4.0%}):"
            f" waited {c.get('waited_once', 0)} + {c.get('waited_copy', 0)} copies,"
            f" on arrival {c.get('arrival_once', 0)} + {c.get('arrival_copy', 0)} copies"
        )
    print(json.dumps({"total": report["total"], "lag": report["lag"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
