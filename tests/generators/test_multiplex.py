import threading

from asyncrl.config import load_config
from asyncrl.generators.multiplex import LoopContext, _Merged, generator_process_names, loop_names
from asyncrl.wire.messages import GeneratorFinal, ReadyEvent, VersionEvent


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
    times = dict(load_s=0.0, receive_s=0.0, probe_s=0.0, ready_at=None, served_at=1.0, bytes=8)
    assert m.fold("generator-0", ReadyEvent(version=0)) == []
    assert m.fold("generator-1", ReadyEvent(version=0)) == [ReadyEvent(version=0)]
    assert m.fold("generator-0", VersionEvent(version=2, apply_s=0.1, **times)) == []  # the other still serves 0
    assert m.fold("generator-1", VersionEvent(version=1, apply_s=0.2, **times)) == [
        VersionEvent(version=1, apply_s=0.2, **times)
    ]
    assert m.fold("generator-1", VersionEvent(version=2, apply_s=0.3, **times)) == [
        VersionEvent(version=2, apply_s=0.3, **times)
    ]
    final = dict(generated=8, tokens=80, held=0, busy_s=1.0, wall_s=2.0, version=2, eval_prompts=3, resumed=1)
    assert m.fold("generator-0", GeneratorFinal(**final, dropped={"invalid": 1})) == []
    (body,) = m.fold("generator-1", GeneratorFinal(**final, dropped={"invalid": 2}))
    assert isinstance(body, GeneratorFinal) and body.generated == 16 and body.busy_s == 2.0 and body.wall_s == 4.0
    assert body.dropped == {"invalid": 3} and body.version == 2 and body.eval_prompts == 6 and body.resumed == 2


class _Parent:
    role, cfg, endpoints, run_dir = "generator", None, None, None

    def __init__(self):
        self.events = []

    def emit(self, event):
        self.events.append(event)

    def stop_requested(self):
        return False


def test_a_failed_loop_stops_the_others():
    parent, failed = _Parent(), threading.Event()
    ctx = LoopContext(parent, "generator-3", _Merged(["generator-3"]), threading.Lock(), failed)
    assert ctx.name == "generator-3" and not ctx.stop_requested()
    ctx.emit(ReadyEvent(version=0))
    assert parent.events == [ReadyEvent(version=0)]
    failed.set()
    assert ctx.stop_requested()
