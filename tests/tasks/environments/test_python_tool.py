"""``run_python``: the model's code in a fresh process with time, memory and file limits, no network
and no other programs."""

import asyncio
import os
import socket

from asyncrl.tasks.environments.python_tool import PythonLimits, describe, run_python, run_sandboxed
from asyncrl.tasks.environments.tool_runner import ToolRunner

FAST = PythonLimits(cpu_s=1, wall_s=2.0, file_bytes=1 << 20, output_chars=400)


def answer(code: str) -> str:
    return describe(run_sandboxed(code, FAST), FAST)


def test_it_returns_what_the_code_printed():
    assert run_python("print(6 * 7)\nprint('done')") == "42\ndone"
    assert run_python("x = 1") == "(no output)"


def test_a_syntax_error_gives_the_line_and_the_error():
    text = answer("x = 1\ndef f(:\n    pass")
    assert 'File "<code>", line 2' in text and "def f(:" in text and text.endswith("SyntaxError: invalid syntax")


def test_an_exception_gives_its_source_line_and_the_output_before_it():
    text = answer("print('before')\nx = 1 / 0")
    assert text.startswith("before\n") and "x = 1 / 0" in text and text.endswith("ZeroDivisionError: division by zero")
    assert "<sandbox>" not in text  # the traceback starts at the model's code


def test_an_endless_loop_is_stopped_by_the_cpu_limit():
    limits = PythonLimits(cpu_s=1, wall_s=10.0)  # the CPU limit first, even on a busy machine
    run = run_sandboxed("while True:\n    pass", limits)
    assert run.returncode is not None and run.returncode < 0 and run.seconds < limits.wall_s
    assert describe(run, limits) == "error: the code used more than 1 s of CPU time and was stopped"


def test_a_sleeping_process_is_stopped_by_the_wall_clock():
    run = run_sandboxed("import time\nprint('start', flush=True)\ntime.sleep(60)", PythonLimits(wall_s=0.5))
    assert run.returncode is None and run.seconds < 2.0
    assert describe(run, FAST) == "start\nerror: the code took longer than 2 s and was stopped"


def test_a_connection_to_localhost_is_refused_by_the_hook():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.0)
        port = server.getsockname()[1]
        text = answer(f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))")
        try:
            server.accept()
            accepted = True
        except BlockingIOError:
            accepted = False
    assert text.endswith("PermissionError: network access is not allowed here (socket.connect)")
    assert not accepted
    assert answer("import socket\nsocket.getaddrinfo('example.com', 80)").endswith("(socket.getaddrinfo)")


def test_other_programs_are_refused():
    assert answer("import os\nos.system('echo hi')").endswith("running programs is not allowed here (os.system)")
    text = answer("import subprocess\nsubprocess.run(['echo', 'hi'])")
    assert text.endswith("running programs is not allowed here (subprocess.Popen)") and "hi\n" not in text
    assert answer("import os\nos.fork()").endswith("(os.fork)")
    assert answer("import _posixsubprocess\n_posixsubprocess.fork_exec()").endswith("(_posixsubprocess.fork_exec)")
    assert answer("import os\nos.kill(os.getppid(), 9)").endswith("signalling processes is not allowed here (os.kill)")


def test_a_large_file_is_stopped_and_writes_stay_in_the_work_directory(tmp_path):
    assert answer("open('big', 'wb').write(b'x' * (4 << 20))").endswith("OSError: [Errno 27] File too large")
    outside = tmp_path / "escape.txt"
    text = answer(f"open({str(outside)!r}, 'w')")
    assert "PermissionError: writing outside the work directory is not allowed here" in text
    assert not outside.exists()
    assert answer("open('note.txt', 'w').write('hi')\nprint(open('note.txt').read())") == "hi"


def test_the_work_directory_is_fresh_and_removed_afterwards():
    run = run_sandboxed("import os\nprint(os.getcwd(), os.listdir('.'))", FAST)
    assert run.stdout.strip() == f"{os.path.realpath(run.workdir)} []"
    assert not os.path.exists(run.workdir)


def test_long_output_is_cut_to_the_limit():
    text = answer("print('x' * 10000)")
    assert len(text) <= FAST.output_chars and text.endswith("…[truncated]")


def test_it_runs_as_a_tool_of_the_runner():
    runner = ToolRunner({"python": "asyncrl.tasks.environments.python_tool:run_python"}, timeout_s=15.0)
    try:
        result = asyncio.run(runner.call("python", {"code": "print(sum(range(10)))"}))
    finally:
        runner.close()
    assert (result.content, result.error) == ("45", None)
