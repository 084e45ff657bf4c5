"""A warm Python for the processes the tests start: each `python -m ...` (and `lean ...`, `accelerate ...`) forks from a
server that has torch, diffusers (with peft and transformers) and mlflow imported, instead of importing them again.

Why: on 2 cores every fresh process spends ~4-5 CPU-seconds importing those before it runs a line of lean, and the
suite starts over a hundred (the smoke pipeline's stages and notebook kernels, `lean launch`'s ranks, CLI runs).

How: `start(folder)` runs the server (`python warm_python.py serve SOCKET`) and writes shims named `python`, `lean`
and `accelerate` into ``folder``; a test puts ``folder`` first on PATH (``conftest`` does it for the whole worker). A
shim is a client on the interpreter without ``site`` (milliseconds): it sends the command line, working directory and
environment with its own stdin, stdout and stderr descriptors, and the server forks a child that takes them over and
runs the module as ``python -m`` would (``sys.path[0]`` the working directory, ``__main__``, the child's own
``sys.executable`` the shim, so that its own children are warm too). The server reaps the child and sends its exit
status; the client exits with it, or dies of the same signal. Signals sent to the client (TERM, INT, HUP, USR1/2)
are forwarded to the child; a client killed outright (SIGKILL) takes its child with it. lean itself is never
preloaded: a child imports the lean on its own ``sys.path`` (the smoke pipeline's copy of the repository).

The shim runs `python [-u] -m MODULE ...` and `python [-u] SCRIPT.py ...` warm; what it does not recognise (``-c``,
other interpreter flags, a different PYTHONPATH or PYTHONHASHSEED than the server's) it hands to the real interpreter
unchanged.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "diffusers.models.transformers", "peft", "mlflow", "matplotlib", "PIL.Image")
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
# What the shims run: the console scripts `lean` and `accelerate` as the modules behind them.
SHIMS = {"python": (), "lean": ("-m", "lean.cli"), "accelerate": ("-m", "accelerate.commands.accelerate_cli")}
_SAME_IN_SERVER = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONSAFEPATH",
)  # read at interpreter start: a child cannot change them


# ---------------------------------------------------------------- the server (a long-lived process per pytest worker)


def serve(path: str) -> None:
    import gc
    import json
    import selectors
    import signal
    import socket
    import threading

    for name in PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, "a preloaded module started a thread: forking would copy a locked state"
    gc.freeze()  # the preloaded objects out of the collector's reach: a child's collections do not copy their pages
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                while not message.endswith(b"\n"):  # a long environment arrives in several reads
                    message += conn.recv(1 << 16)
                request = json.loads(message)
                sys.stdout.flush(), sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the child: becomes the requested process (never returns here)
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    _become(request, fds, conn)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"pid {pid}\n".encode())
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client closed its end while its child runs: it was killed, so is the child
                try:
                    os.kill(key.data, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                selector.unregister(key.fileobj)
        _reap(children, selector)


def _reap(children: dict, selector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        try:
            selector.unregister(conn)
        except KeyError:
            pass
        try:
            conn.sendall(f"status {status}\n".encode())
        except OSError:
            pass
        conn.close()


def _become(request: dict, fds: list[int], conn) -> None:
    """In the forked child: take over the client's descriptors, directory, environment and command line, then run
    the module as ``__main__``. SystemExit and uncaught errors leave through the interpreter's own exit."""
    import io
    import runpy
    import threading
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = request["unbuffered"]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        open(1, "wb", closefd=False, buffering=0 if unbuffered else -1), write_through=unbuffered
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", closefd=False, buffering=0 if unbuffered else -1), errors="backslashreplace", line_buffering=True
    )
    sys.executable = request["executable"]
    script = request.get("script")
    sys.path.insert(0, os.path.dirname(script) if script else request["cwd"])  # as `python script` / `python -m`
    sys.argv = [script or request["module"], *request["args"]]

    def watch_client() -> None:  # the client's connection closes when it dies: die with it
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os._exit(137)

    threading.Thread(target=watch_client, daemon=True).start()
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """The interpreter's exit without its teardown: the non-daemon threads joined, the atexit functions run, the
    streams flushed, then ``os._exit``. Tearing down the inherited modules would touch every page the child shares
    with the server (copy-on-write): seconds per process."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# ---------------------------------------------------------------- the client (the shims)

CLIENT = r"""
import json, os, signal, socket, sys
SOCKET, REAL, PREFIX, SERVER_ENV = {socket!r}, {real!r}, {prefix!r}, {server_env!r}
argv = [*PREFIX, *sys.argv[1:]]
unbuffered = False
while argv and argv[0] == "-u":
    unbuffered, argv = True, argv[1:]
if len(argv) >= 2 and argv[0] == "-m":
    target, args = dict(module=argv[1]), argv[2:]
elif argv and argv[0].endswith(".py") and os.path.isfile(argv[0]):
    target, args = dict(script=os.path.abspath(argv[0])), argv[1:]
else:
    target = args = None
same = all(os.environ.get(k) == v for k, v in SERVER_ENV.items())
if target is None or not same or not os.path.exists(SOCKET):
    os.execv(REAL, [REAL, *PREFIX, *sys.argv[1:]])
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(SOCKET)
except OSError:
    os.execv(REAL, [REAL, *PREFIX, *sys.argv[1:]])
request = dict(target, args=args, cwd=os.getcwd(), env=dict(os.environ), unbuffered=unbuffered,
               executable=sys.argv[0] if os.path.isabs(sys.argv[0]) else os.path.abspath(sys.argv[0]))
request["executable"] = os.path.join(os.path.dirname(request["executable"]), "python")
socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
reader = conn.makefile("r")
child = None
def forward(signum, frame):
    if child:
        os.kill(child, signum)
for name in {signals!r}:
    signal.signal(getattr(signal, name), forward)
for line in reader:
    kind, value = line.split()
    if kind == "pid":
        child = int(value)
    elif kind == "status":
        status = int(value)
        if os.WIFSIGNALED(status):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        sys.exit(os.waitstatus_to_exitcode(status))
sys.exit(1)  # the server went away
"""


def start(folder: Path, wait: bool = True) -> subprocess.Popen:
    """Starts the server with its socket in ``folder`` and writes the shims there; returns the server's process.
    Without ``wait`` it returns at once: until the server listens, the shims run the real interpreter."""
    folder.mkdir(parents=True, exist_ok=True)
    socket_path = str(folder / "server.sock")
    server_env = {k: os.environ.get(k) for k in _SAME_IN_SERVER}
    server = subprocess.Popen(
        [sys.executable, __file__, "serve", socket_path],
        stdout=subprocess.PIPE if wait else subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    for name, prefix in SHIMS.items():
        shim = folder / name
        body = CLIENT.format(
            socket=socket_path, real=sys.executable, prefix=prefix, server_env=server_env, signals=FORWARDED_SIGNALS
        )
        shim.write_text(f"#!{sys.executable} -S\n{body}")
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    if wait and server.stdout.readline().strip() != b"ready":  # printed once the imports are done
        server.kill()
        raise RuntimeError("the warm Python server did not start")
    return server


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    sys.path.pop(0)  # the tests/ folder: a child's modules come from its own directory and PYTHONPATH
    serve(sys.argv[2])
