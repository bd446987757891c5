"""``run_python``: a built-in tool that runs the model's Python code in a fresh, limited process.

Each call starts ``python -I -c BOOTSTRAP`` (isolated mode: no ``PYTHON*`` variables, no user
site, no script directory on ``sys.path``) in a fresh temporary directory, removed afterwards,
with an environment of ``PATH`` and ``LANG`` only. The bootstrap reads the code from stdin, sets
the limits, installs an audit hook and runs the code. What that protects against:

- **time**: ``cpu_s`` of CPU time (the kernel stops it), ``wall_s`` of wall-clock time (then it
  is killed: a ``time.sleep`` uses no CPU);
- **memory**: ``memory_bytes`` of address space (an allocation past it is a ``MemoryError``);
- **disk**: no file (stdout and stderr included) grows past ``file_bytes``, at most
  ``open_files`` files are open at once, no core dump; files are written, created, removed and
  renamed inside the temporary directory only, and permissions are not changed;
- **network**: no connect, bind, send to an address or name lookup (``socket.connect``,
  ``socket.bind``, ``socket.sendto``, ``socket.getaddrinfo``, ... raise ``PermissionError``);
- **other programs**: no ``subprocess``, ``os.system``, ``os.exec*``, ``os.spawn*``,
  ``os.posix_spawn``, ``os.fork`` or ``pty`` (``_posixsubprocess.fork_exec``, which has no audit
  event, is replaced by one that refuses); no signals to other processes (``os.kill``); ``ctypes``
  imports (numpy needs it) but looks up and calls no C function.

What it does NOT protect against: it is not a security boundary against a determined attacker.
There are no namespaces, no seccomp filter and no separate user: the code runs as this user, can
read every file this user can, and an audit hook only sees what CPython reports to it (a bug or
a C extension that calls the OS directly gets past it; ``gc`` object walks and replacing the
code of the hook's own functions are refused to make tampering with it harder, not impossible). It is
meant for a model's honest mistakes (an endless loop, a huge allocation, a stray
``rm``-like call or download), on a machine that holds nothing the model must not read. Run
untrusted code in a container or VM.

The tool returns what the code printed to stdout, cut to ``output_chars``; when the code fails,
the end of its stderr (the traceback's last lines) as well, or why it was stopped. The limits are
``LIMITS``, not arguments of the tool (the model would choose them). The process stays in its
caller's process group, so a ``ToolRunner`` that kills its child for time kills it too; give that
runner a ``timeout_s`` longer than ``wall_s``, or the work directory is left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0
"""Seconds to wait for a killed process to be reaped."""


@dataclass(frozen=True)
class PythonLimits:
    cpu_s: int = 3
    """Seconds of CPU time (the kernel stops the process past it)."""
    wall_s: float = 5.0
    """Seconds of wall-clock time before the process is killed. A ``ToolRunner`` running the tool
    needs a ``timeout_s`` a second or more longer: if it kills its child first, this process dies
    with it but its work directory is left behind."""
    memory_bytes: int = 512 << 20
    """Address space (RLIMIT_AS)."""
    open_files: int = 32
    """Open file descriptors at once (RLIMIT_NOFILE)."""
    file_bytes: int = 8 << 20
    """Largest file it may write, its stdout and stderr included (RLIMIT_FSIZE)."""
    output_chars: int = 2000
    """Longest answer the tool returns."""


LIMITS = PythonLimits()
"""The limits ``run_python`` runs under. Not arguments of the tool: the model chooses those."""


@dataclass
class SandboxRun:
    """How one run of code ended."""

    stdout: str
    stderr: str
    returncode: int | None
    """The exit status (negative: killed by that signal); None when it was killed for wall time."""
    seconds: float
    workdir: str
    """The temporary directory it ran in (removed by the time this is returned)."""


# Runs in the sandboxed interpreter, under the name "<sandbox>" (LAUNCH compiles it so: its hook
# guards the functions of that file); argv: the work directory, then the limits. The hook's state
# is bound in default arguments (read-only views), so that code which replaces the globals or the
# builtins it would look up does not change what it refuses. Everything it imports is imported
# before the hook is installed.
LAUNCH = "import sys; exec(compile(sys.argv.pop(1), '<sandbox>', 'exec'))"

BOOTSTRAP = r"""
import _posixsubprocess, linecache, os, resource, signal, subprocess, sys, traceback, types
code = sys.stdin.read()
root = os.path.realpath(sys.argv[1])
cpu, memory, files, fsize = (int(v) for v in sys.argv[2:6])
for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                          (resource.RLIMIT_NOFILE, files, files), (resource.RLIMIT_FSIZE, fsize, fsize),
                          (resource.RLIMIT_CORE, 0, 0)):
    limit = resource.getrlimit(which)[1]
    if limit != resource.RLIM_INFINITY:
        soft, hard = min(soft, limit), min(hard, limit)
    resource.setrlimit(which, (soft, hard))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past file_bytes raises OSError, not a kill
sys.dont_write_bytecode = True
REFUSED = {
    "socket.connect": "network access", "socket.bind": "network access", "socket.sendto": "network access",
    "socket.sendmsg": "network access", "socket.getaddrinfo": "network access",
    "socket.gethostbyname": "network access", "socket.gethostbyaddr": "network access",
    "socket.getnameinfo": "network access", "socket.sethostname": "network access",
    "subprocess.Popen": "running programs", "os.system": "running programs", "os.exec": "running programs",
    "os.spawn": "running programs", "os.posix_spawn": "running programs", "os.fork": "running programs",
    "os.forkpty": "running programs", "os.startfile": "running programs",
    "os.kill": "signalling processes", "os.killpg": "signalling processes",
    "resource.setrlimit": "changing limits", "resource.prlimit": "changing limits",
    "os.chmod": "changing permissions", "os.chown": "changing permissions", "os.chflags": "changing permissions",
    "gc.get_objects": "walking the objects", "gc.get_referrers": "walking the objects",
    "gc.get_referents": "walking the objects",
    "ctypes.dlsym": "calling C", "ctypes.dlsym/handle": "calling C", "ctypes.call_function": "calling C",
    "ctypes.cdata": "calling C", "ctypes.string_at": "calling C", "ctypes.wstring_at": "calling C",
    "sys.addaudithook": "adding audit hooks",
}
WRITES = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (1,),
          "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
          "shutil.rmtree": (0,)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

def hook(event, args, refused=types.MappingProxyType(REFUSED), writes=types.MappingProxyType(WRITES), root=root,
         write_flags=WRITE_FLAGS, deny=PermissionError, here=sys._getframe().f_code.co_filename,
         realpath=os.path.realpath, fspath=os.fspath, fsdecode=os.fsdecode, sep=os.sep):
    if event in refused:
        raise deny(f"{refused[event]} is not allowed here ({event})")
    if event == "import" and args[0] == "_posixsubprocess":  # a fresh copy would have fork_exec back
        raise deny("running programs is not allowed here (importing _posixsubprocess again)")
    if (event == "object.__setattr__" and type(args[0]).__name__ == "function"
            and args[1] in ("__code__", "__defaults__", "__kwdefaults__") and args[0].__code__.co_filename == here):
        raise deny(f"replacing the sandbox's {args[1]} is not allowed here")
    paths = ()
    if event == "open" and not isinstance(args[0], int) and (args[2] & write_flags):
        paths = (args[0],)
    if event in writes:
        paths = tuple(args[i] for i in writes[event] if not isinstance(args[i], int))
    for path in paths:
        full = realpath(fsdecode(fspath(path)))
        if full != root and not full.startswith(root + sep):
            raise deny(f"writing outside the work directory is not allowed here ({event}: {full})")

def refuse_fork_exec(*args, deny=PermissionError):
    raise deny("running programs is not allowed here (_posixsubprocess.fork_exec)")

# fork_exec starts programs without an audit event of its own: it is taken away (subprocess stays
# importable, as asyncio needs it; its Popen is refused by the hook).
_posixsubprocess.fork_exec = subprocess._fork_exec = refuse_fork_exec
linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # source lines in tracebacks
sys.argv = ["<code>"]
sys.addaudithook(hook)
del REFUSED, WRITES, WRITE_FLAGS, hook, refuse_fork_exec
try:
    exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this bootstrap's frame
    sys.exit(1)
"""


def run_sandboxed(code: str, limits: PythonLimits = LIMITS) -> SandboxRun:
    """Run ``code`` in a fresh limited interpreter (see the module docstring); blocks for at most
    ``limits.wall_s`` plus the reaping of a killed process (``KILL_WAIT_S``)."""
    workdir = tempfile.mkdtemp(prefix="asyncrl-python-")
    argv = [sys.executable, "-I", "-c", LAUNCH, BOOTSTRAP, workdir]
    argv += [str(v) for v in (limits.cpu_s, limits.memory_bytes, limits.open_files, limits.file_bytes)]
    env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"}
    start = time.monotonic()
    try:
        # Files, not pipes: RLIMIT_FSIZE bounds what the code prints, and nothing here must keep
        # up with it. Unnamed, so they vanish with their handles.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir, env=env)
            try:
                proc.communicate(code.encode("utf-8", "replace"), timeout=limits.wall_s)
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    log.warning("the python tool's process %d was killed but did not exit", proc.pid)
                returncode = None
            seconds = time.monotonic() - start
            stdout, stderr = _head(out, limits.output_chars), _tail(err, limits.output_chars)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if os.path.exists(workdir):
            log.warning("the python tool's work directory %s could not be removed", workdir)
    return SandboxRun(stdout=stdout, stderr=stderr, returncode=returncode, seconds=seconds, workdir=workdir)


def _head(file, chars: int) -> str:
    file.seek(0)
    return file.read(4 * chars + 4).decode("utf-8", "replace")


def _tail(file, chars: int) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - 4 * chars))
    return file.read().decode("utf-8", "replace")


def describe(run: SandboxRun, limits: PythonLimits = LIMITS) -> str:
    """What the tool answers for ``run``: its stdout, and on failure the end of its stderr or why
    it was stopped; at most ``limits.output_chars`` characters."""
    chars = limits.output_chars
    if run.returncode is None:
        why = f"error: the code took longer than {limits.wall_s:g} s and was stopped"
    elif run.returncode == -signal.SIGXCPU:
        why = f"error: the code used more than {limits.cpu_s} s of CPU time and was stopped"
    elif run.returncode == -signal.SIGKILL:  # the CPU time's hard limit, or the kernel out of memory
        why = f"error: the code was killed (more than {limits.cpu_s} s of CPU time, or out of memory)"
    elif run.returncode < 0:
        why = f"error: the code was stopped by signal {signal.Signals(-run.returncode).name}"
    elif run.returncode != 0:
        lines = run.stderr.rstrip().splitlines()
        why = "\n".join(lines[-6:])[-(chars // 2) :] or f"error: the code exited with status {run.returncode}"
    else:
        why = ""
    room = chars - len(why) - 1
    stdout = run.stdout if len(run.stdout) <= room else run.stdout[: max(0, room - 12)] + "…[truncated]"
    text = "\n".join(part for part in (stdout.rstrip("\n"), why) if part)
    return text[:chars] or "(no output)"


def run_python(code: str) -> str:
    """Run Python ``code`` and return what it printed (and its error, if it failed).

    The code runs in a fresh process, without network access, without starting other programs,
    with limits on time, memory and files; nothing persists between calls.
    """
    if not isinstance(code, str):
        return f"error: code must be a string of Python source, not a {type(code).__name__}"
    return describe(run_sandboxed(code))
