import threading

from asyncrl.config import load_config
from asyncrl.generators.multiplex import LoopContext, _Merged, generator_process_names, loop_names


def test_engines_are_packed_into_processes_with_distinct_loop_names():
    cfg = load_config(
        "configs/bench_pipeline.yaml", ["run.num_generators=5", "simulation.generator.engines_per_process=2"]
    )
    assert generator_process_names(cfg) == ["generators-0", "generators-1", "generators-2"]
    assert [loop_names(cfg, p) for p in generator_process_names(cfg)] == [
        ["generator-0", "generator-1"],
        ["generator-2", "generator-3"],
        ["generator-4"],
    ]
    one = load_config("configs/bench_pipeline.yaml", ["run.num_generators=2"])
    assert generator_process_names(one) == ["generator-0", "generator-1"]
    assert loop_names(one, "generator-1") == ["generator-1"]


def test_loop_events_fold_into_one_generator():
    m = _Merged(["generator-0", "generator-1"])
    assert m.fold("generator-0", "ready", {"version": 0}) == []
    assert m.fold("generator-1", "ready", {"version": 0}) == [("ready", {"version": 0})]
    assert m.fold("generator-0", "version", {"version": 2, "apply_s": 0.1}) == []  # the other still serves 0
    assert m.fold("generator-1", "version", {"version": 1, "apply_s": 0.2}) == [
        ("version", {"version": 1, "apply_s": 0.2})
    ]
    assert m.fold("generator-1", "version", {"version": 2, "apply_s": 0.3}) == [
        ("version", {"version": 2, "apply_s": 0.3})
    ]
    final = {"generated": 8, "tokens": 80, "held": 0, "busy_s": 1.0, "wall_s": 2.0, "version": 2}
    assert m.fold("generator-0", "final", {**final, "dropped": {"invalid": 1}}) == []
    ((kind, body),) = m.fold("generator-1", "final", {**final, "dropped": {"invalid": 2}})
    assert kind == "final" and body["generated"] == 16 and body["busy_s"] == 2.0 and body["wall_s"] == 4.0
    assert body["dropped"] == {"invalid": 3} and body["version"] == 2


class _Parent:
    role, cfg, endpoints, run_dir = "generator", None, None, None

    def __init__(self):
        self.events = []

    def emit(self, type, **fields):
        self.events.append((type, fields))

    def stop_requested(self):
        return False


def test_a_failed_loop_stops_the_others():
    parent, failed = _Parent(), threading.Event()
    ctx = LoopContext(parent, "generator-3", _Merged(["generator-3"]), threading.Lock(), failed)
    assert ctx.name == "generator-3" and not ctx.stop_requested()
    ctx.emit("ready", version=0)
    assert parent.events == [("ready", {"version": 0})]
    failed.set()
    assert ctx.stop_requested()
