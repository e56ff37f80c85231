"""A warm worker: run a command in a fork of a process that has already imported torch, transformers, Kedro and
MLflow, so that a pipeline of many short stages spends its time working, not starting Python.

    python -m layertune.warm kedro run --pipelines train --params study=ablation,cell=...

The first call starts a server for this project folder, Python and import-time environment (it imports once, a
few seconds); each call then forks it, and the command runs in the fork with the caller's working directory,
environment, arguments and standard streams (passed as file descriptors). The call exits with the command's exit
code. Ctrl-C and SIGTERM are passed on to the command; if the caller dies, the command is stopped. A server that
sees a source file it imported change (or installed packages change) refuses and exits, so a call never runs stale
code: a new server starts. It also exits after ``LAYERTUNE_WARM_IDLE`` seconds without work (default 120).

``LAYERTUNE_WARM=0`` runs commands directly (the same results, a slower start), as do platforms without fork.
``LAYERTUNE_WARM_PRELOAD`` (comma-separated module names) replaces the modules a server imports first.
This module uses the standard library only, so a call itself starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Environment variables read when a module is imported (thread pools, hub settings, Python's own): a server serves
# only callers with the same values. Everything else is passed to the command as it is.
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                   "PYTHON", "KEDRO_", "MPLBACKEND", "LAYERTUNE_WARM")
PRELOAD = ("torch", "transformers", "datasets", "accelerate", "safetensors.torch", "pandas", "numpy", "pyarrow",
           "scipy.stats", "seqeval.metrics.sequence_labeling", "mlflow", "mlflow.entities",
           "mlflow.store.tracking.sqlalchemy_store", "kedro.framework.cli.cli",
           "kedro.framework.session", "kedro.io", "matplotlib.pyplot", "seaborn",
           "transformers.models.bert.modeling_bert", "transformers.models.roberta.modeling_roberta")
STARTUP_TIMEOUT_S = 120
MAX_SOCKET_PATH = 100
MESSAGE = 1 << 20


class Unavailable(RuntimeError):
    """No server could be reached or started; the command runs directly instead."""


# ------------------------------------------------------------------------------------------------------- client


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        return serve(Path(argv[1]))
    if not argv or argv[0].startswith("-"):
        print("usage: python -m layertune.warm <command> [args...]   (e.g. kedro run --pipelines train)",
              file=sys.stderr)
        return 2
    if not enabled():
        return _exec(argv)
    try:
        return call(argv)
    except Unavailable as error:
        print(f"layertune.warm: {error}; running the command directly", file=sys.stderr)
        return _exec(argv)


def enabled() -> bool:
    return os.environ.get("LAYERTUNE_WARM", "1") != "0" and hasattr(os, "fork") and hasattr(socket, "send_fds")


def _exec(argv: list[str]) -> int:
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        print(f"layertune.warm: no command {argv[0]!r}", file=sys.stderr)
        return 127


def socket_path() -> Path:
    """One server per project folder, interpreter and import-time environment."""
    identity = [os.getcwd(), sys.executable,
                sorted((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV))]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    name = f"layertune-warm-{os.getuid()}-{digest}.sock"
    folder = Path(os.environ.get("LAYERTUNE_WARM_DIR") or tempfile.gettempdir())
    if len(str(folder / name)) > MAX_SOCKET_PATH:  # the limit of a Unix socket's address
        folder = Path(tempfile.gettempdir())
    return folder / name


def call(argv: list[str]) -> int:
    """Run ``argv`` in a fork of the server (started if needed) and return its exit code."""
    path = socket_path()
    for _ in range(2):  # a stale server refuses once; the second try reaches a fresh one
        connection = _connect_or_start(path)
        umask = os.umask(0)
        os.umask(umask)
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}
        socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
        reply = _receive(connection)  # {"started": pid}, or {"stale": true} from a server about to go
        if reply.get("stale"):
            connection.close()
            _wait_gone(path)
            continue
        if "started" not in reply:
            raise Unavailable("the server did not take the request")
        return _wait_for_exit(connection)
    raise Unavailable("the server kept refusing the request as stale")


def _connect(path: Path) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(str(path))
        return connection
    except OSError:
        connection.close()
        return None


def _connect_or_start(path: Path) -> socket.socket:
    connection = _connect(path)
    if connection is not None:
        return connection
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one caller starts the server; the others wait for it here
        connection = _connect(path)
        if connection is not None:
            return connection
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by a server that died
        log = open(f"{path}.log", "ab")
        server = subprocess.Popen([sys.executable, "-m", "layertune.warm", "--serve", str(path)], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log, start_new_session=True, close_fds=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            connection = _connect(path)
            if connection is not None:
                return connection
            if server.poll() is not None:
                raise Unavailable(f"the server exited while starting (see {path}.log)")
            time.sleep(0.05)
        server.kill()
        raise Unavailable(f"the server did not start within {STARTUP_TIMEOUT_S} s (see {path}.log)")


def _wait_gone(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _receive(connection: socket.socket) -> dict:
    data = connection.recv(MESSAGE)
    return json.loads(data) if data else {}


def _wait_for_exit(connection: socket.socket) -> int:
    """Pass Ctrl-C, SIGTERM and SIGHUP on to the command until its exit code arrives."""

    def forward(signum, frame):
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"signal": signum}).encode())

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            reply = _receive(connection)
            if not reply:
                print("layertune.warm: the server went away before the command finished", file=sys.stderr)
                return 1
            if "exit" in reply:
                return int(reply["exit"])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# ------------------------------------------------------------------------------------------------------- server


def serve(path: Path) -> int:
    """Import, listen on ``path``, fork one child per request; stop accepting when idle or when the code went
    stale, and exit once every child has reported back."""
    import threading

    preload = os.environ.get("LAYERTUNE_WARM_PRELOAD")
    for module in PRELOAD if preload is None else [m for m in preload.split(",") if m]:
        with contextlib.suppress(Exception):  # a missing optional module is imported (and fails) in the command
            __import__(module)
    _import_project()
    if threading.active_count() > 1:  # forking a process with threads can deadlock its children
        print(f"layertune.warm: {threading.active_count()} threads after imports", file=sys.stderr)
    watched = _watched_files()
    idle_after = float(os.environ.get("LAYERTUNE_WARM_IDLE", "120"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    os.chmod(path, 0o600)  # only this user may have the server run commands
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    last_work, accepting = time.monotonic(), True
    while accepting or children:
        for key, _ in selector.select(timeout=0.1):
            if key.fileobj is listener:
                accepting = _accept(listener.accept()[0], watched, selector, children) and accepting
            else:
                _on_message(key.fileobj, children, selector)
        if _reap(children, selector):
            last_work = time.monotonic()
        if accepting and not children and time.monotonic() - last_work > idle_after:
            accepting = False
        if not accepting and listener.fileno() >= 0:
            _stop_listening(path, listener, watched, selector, children)
    return 0


def _stop_listening(path: Path, listener, watched, selector, children) -> None:
    """Remove the socket first (callers from now on start a new server), then serve whoever already connected."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener.setblocking(False)
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            break
        connection.setblocking(True)
        _accept(connection, watched, selector, children)
    selector.unregister(listener)
    listener.close()


def _import_project() -> None:
    """The Kedro project of the working folder (its settings, hooks and every pipeline), if it is one."""
    if not Path("pyproject.toml").is_file():
        return
    with contextlib.suppress(Exception):
        from kedro.framework.startup import bootstrap_project

        bootstrap_project(Path.cwd())
        from kedro.framework.project import pipelines

        dict(pipelines)  # imports every pipeline's nodes, and through them the library


def _watched_files() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every imported source file of the project folder and of layertune (wherever installed),
    and of the folders packages are installed in (installing or removing one changes them)."""
    import sysconfig

    roots = [Path.cwd().resolve(), Path(__file__).resolve().parent]
    files = {source for module in list(sys.modules.values())
             if (source := getattr(module, "__file__", None)) and any(Path(source).resolve().is_relative_to(r)
                                                                       for r in roots)}
    files |= {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return {name: _stat(name) for name in sorted(files)}


def _stat(name: str) -> tuple[int, int]:
    try:
        info = os.stat(name)
        return info.st_mtime_ns, info.st_size
    except OSError:
        return (0, 0)


def _accept(connection, watched, selector, children) -> bool:
    """Fork a child for the request on ``connection``; False (and the request refused) when the imported code
    changed since the server started."""
    data, fds, _, _ = socket.recv_fds(connection, MESSAGE, 3)
    request = json.loads(data)
    if any(_stat(name) != stamp for name, stamp in watched.items()):
        connection.send(json.dumps({"stale": True}).encode())
        for fd in fds:
            os.close(fd)
        connection.close()
        return False
    pid = os.fork()
    if pid == 0:
        for key in list(selector.get_map().values()):  # the listener and other callers' connections: not ours
            key.fileobj.close()
        selector.close()
        _child(request, fds, connection)  # never returns
    for fd in fds:
        os.close(fd)
    connection.send(json.dumps({"started": pid}).encode())
    children[pid] = connection
    selector.register(connection, selectors.EVENT_READ)
    return True


def _on_message(connection, children, selector) -> None:
    """A forwarded signal, or the caller gone (then the command is stopped)."""
    pid = next(p for p, c in children.items() if c is connection)
    data = connection.recv(MESSAGE)
    signum = json.loads(data)["signal"] if data else signal.SIGTERM
    if not data:
        selector.unregister(connection)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def _reap(children, selector) -> bool:
    """Send each finished child's exit code to its caller; True if any finished."""
    finished = False
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return finished
        if pid == 0:
            return finished
        connection = children.pop(pid, None)
        if connection is None:
            continue
        finished = True
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"exit": code if code >= 0 else 128 - code}).encode())
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(connection)
        connection.close()
    return finished


def _child(request: dict, fds: list[int], connection: socket.socket) -> None:
    """In the fork: become the caller's process (folder, environment, streams, arguments), run, exit."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: signals reach it and whatever it starts
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reopen_streams()
        code = _run(request["argv"])
    except SystemExit as exit_:
        code = _exit_code(exit_)
    except BaseException:  # noqa: BLE001 - the command's own failure: report it as Python would, and exit
        traceback.print_exc()
        code = 130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1
    finally:
        _exit(code)


def _reopen_streams() -> None:
    buffered = not os.environ.get("PYTHONUNBUFFERED")
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=-1 if buffered and not os.isatty(1) else 1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _run(argv: list[str]) -> int:
    """A console script of this environment (``kedro ...``), or ``python -m module ...``."""
    import runpy
    from importlib.metadata import entry_points

    if Path(argv[0]).name.startswith("python") and argv[1:2] == ["-m"] and len(argv) > 2:
        sys.argv = argv[2:]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        return 0
    scripts = entry_points(group="console_scripts", name=Path(argv[0]).name)
    if not scripts:
        print(f"layertune.warm: {argv[0]!r} is not a console script of this environment", file=sys.stderr)
        return 127
    sys.argv = argv
    result = next(iter(scripts)).load()()
    return result if isinstance(result, int) else 0


def _exit_code(exit_: SystemExit) -> int:
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """Exit as Python would (atexit handlers, flushed streams), without unwinding into the server's loop."""
    import atexit

    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
