"""``ToolRunner``: tool calls in a child process; every failure is an error result, and the next
call after a timeout or a crash gets a fresh child."""

import asyncio
import os

import pytest

from asyncrl.tasks.environments.tool_runner import ToolResult, ToolRunner

T = "tests.tasks.environments.tools_for_tests"
TOOLS = {name: f"{T}:{name}" for name in ("add", "echo", "later", "fails", "hangs", "exits", "hogs", "a_set", "pid")}


def calls(*requests, **options) -> tuple[list[ToolResult], ToolRunner]:
    """The results of ``requests`` ((name, arguments) pairs, one after the other) on a fresh runner, closed after."""
    runner = ToolRunner({**TOOLS, **options.pop("tools", {})}, **{"timeout_s": 1.0, **options})

    async def go():
        return [await runner.call(name, arguments) for name, arguments in requests]

    try:
        return asyncio.run(go()), runner
    finally:
        runner.close()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_call_returns_the_functions_result_as_text():
    (result, as_json), runner = calls(("add", {"a": 1, "b": 2}), ("later", {"text": "hi"}))
    assert (result.content, result.error) == ("3", None) and result.seconds > 0
    assert (as_json.content, as_json.error) == ('{"text": "hi", "n": 2}', None)  # an async function, awaited
    assert runner.calls == 2 and not runner.errors


def test_an_unknown_tool_and_bad_arguments_are_errors_for_the_model():
    results, runner = calls(("nope", {}), ("add", [1, 2]), ("add", {"a": {1}}), ("add", {"a": 1}))
    assert [r.error for r in results] == ["unknown_tool", "bad_arguments", "bad_arguments", "bad_arguments"]
    assert results[0].content.startswith("error: there is no tool named 'nope'") and "add" in results[0].content
    assert "must be a JSON object, not a list" in results[1].content
    assert "not JSON" in results[2].content
    assert "missing a required argument: 'b'" in results[3].content
    assert runner.errors == {"unknown_tool": 1, "bad_arguments": 3}


def test_an_exception_names_its_type_and_message_and_the_child_serves_on():
    (raised, after), runner = calls(("fails", {"message": "boom"}), ("pid", {}))
    assert (raised.content, raised.error) == ("error: the tool fails raised ValueError: boom", "exception")
    assert after.error is None and runner.restarts == 0


def test_a_hanging_tool_times_out_and_the_next_call_gets_a_fresh_child():
    (first, hung, after), runner = calls(("pid", {}), ("hangs", {}), ("pid", {}))
    assert (hung.content, hung.error) == ("error: the tool hangs took longer than 1 s", "timeout")
    assert 1.0 <= hung.seconds < 5.0
    assert after.error is None and after.content != first.content and gone(int(first.content))
    assert runner.restarts == 1


def test_a_tool_that_kills_its_process_is_a_crash_and_the_next_call_works():
    (crashed, after), runner = calls(("exits", {}), ("add", {"a": 2, "b": 2}))
    assert crashed.error == "crashed" and "exited with code 3" in crashed.content
    assert (after.content, after.error) == ("4", None)
    assert runner.errors == {"crashed": 1}


def test_a_tool_past_the_memory_limit_is_a_crash_and_the_next_call_works():
    (hog, small), _ = calls(("hogs", {"mib": 512}), ("hogs", {"mib": 16}), memory_bytes=256 << 20)
    assert (hog.content, hog.error) == ("error: the tool hogs ran out of memory (limit 256 MiB)", "crashed")
    assert (small.content, small.error) == (str(16 << 20), None)


def test_a_result_that_is_not_json_is_a_bad_result():
    (result,), _ = calls(("a_set", {}))
    assert result.error == "bad_result" and result.content.startswith("error: the tool a_set returned a set")


def test_a_long_result_is_cut_to_the_limit_and_says_so():
    (long, short), runner = calls(("echo", {"text": "x" * 500}), ("echo", {"text": "y" * 100}), max_result_chars=100)
    assert long.error is None and len(long.content) == 100 and long.content.endswith("x…[truncated]")
    assert short.content == "y" * 100
    assert runner.truncated == 1 and not runner.errors


def test_a_tool_that_does_not_import_is_unavailable_the_others_work():
    (broken, fine), runner = calls(("broken", {}), ("add", {"a": 1, "b": 1}), tools={"broken": "tests.nothere:fn"})
    assert broken.error == "load_failed" and "ModuleNotFoundError" in broken.content
    assert fine.content == "2"


def test_concurrent_calls_are_all_answered_in_turn():
    runner = ToolRunner(TOOLS, timeout_s=1.0)

    async def go():
        return await asyncio.gather(*(runner.call("later", {"text": "a" * i}) for i in range(8)))

    try:
        results = asyncio.run(go())
    finally:
        runner.close()
    assert [r.content for r in results] == [f'{{"text": "{"a" * i}", "n": {i}}}' for i in range(8)]


def test_close_leaves_no_child_and_later_calls_are_refused():
    runner = ToolRunner(TOOLS, timeout_s=1.0)

    async def go():
        first = await runner.call("pid", {})
        runner.close()
        runner.close()  # idempotent
        return first, await runner.call("pid", {})

    first, after = asyncio.run(go())
    assert int(first.content) != os.getpid() and gone(int(first.content))
    assert runner.pid is None and after.error == "closed"


def test_a_bad_configuration_is_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"\('calc'\) must be 'module:function'"):
        ToolRunner({"calc": "calc"})
    with pytest.raises(ValueError, match=r"timeout_s \(0\)"):
        ToolRunner(TOOLS, timeout_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        ToolRunner(TOOLS, memory_bytes=1000)
