"""A warm worker: run a command in a fork of a process that has already imported torch, transformers, Kedro and
MLflow, so that a pipeline of many short stages spends its time working, not starting Python.

    python -m pipelines.warm kedro run --pipelines train --params study=ablation,cell=...

The first call starts a server for this project folder, Python and import-time environment (it imports once, a
few seconds); each call then forks it, and the command runs in the fork with the caller's working directory,
environment, arguments and standard streams (passed as file descriptors). The call exits with the command's exit
code. Ctrl-C and SIGTERM are passed on to the command; if the caller dies, the command is stopped; if whatever
started the caller dies (`dvc repro` killed with SIGKILL), the caller gets SIGTERM and passes it on; if the server
dies, the commands it runs get SIGTERM (`pipelines.processes.die_with_parent`). A server that
sees a source file it imported change (or installed packages change) refuses and exits, so a call never runs stale
code: a new server starts. It also exits after ``LAYERTUNE_WARM_IDLE`` seconds without work (default 120).

Freshness: the project's own modules (layertune's, and the working folder's outside the installed packages) run
from their current source, never from a ``.pyc`` that Python trusts by mtime and size (theirs record the source's
hash instead, PEP 552), and the server keeps the hash of the source it imported; each call hashes those files again
(a few dozen, about a millisecond), so an edit is seen even when it keeps the size and restores the mtime. Installed
packages are checked by mtime and size (each imported file, and the folders they are installed in), which is what
pip changes; an in-place edit there that restores both is not seen.

Security: the socket, its lock and the server's log live in a folder only this user can enter ($XDG_RUNTIME_DIR/
layertune-warm, else ``layertune-warm-<uid>`` in the temp folder, or ``LAYERTUNE_WARM_DIR``); a folder that is a
symbolic link, another user's, or open to others is refused. Before sending anything the caller checks that the
server runs as this user (SO_PEERCRED), and the server checks its callers the same way. Whatever is refused runs
the command directly, with one line on stderr saying why.

``LAYERTUNE_WARM=0`` runs commands directly (the same results, a slower start), as do platforms without fork or
SO_PEERCRED.
``LAYERTUNE_WARM_PRELOAD`` (comma-separated module names) replaces the modules a server imports first.
This module imports the standard library only (and `pipelines.processes`, which does too; filelock only to start a
server), so a call itself starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.machinery
import importlib.util
import json
import marshal
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from pipelines.processes import die_with_parent, on_signals

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
PEERCRED = struct.Struct("3i")  # Linux's struct ucred: pid, uid, gid


class Unavailable(RuntimeError):
    """No server could be reached or started; the command runs directly instead."""


# ------------------------------------------------------------------------------------------------------- client


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        return serve(Path(argv[1]))
    if not argv or argv[0].startswith("-"):
        print("usage: python -m pipelines.warm <command> [args...]   (e.g. kedro run --pipelines train)",
              file=sys.stderr)
        return 2
    die_with_parent()  # SIGTERM (passed on to the command) when whatever started this call exits, even by SIGKILL
    if not enabled():
        return _exec(argv)
    try:
        return call(argv)
    except Unavailable as error:
        print(f"pipelines.warm: {error}; running the command directly", file=sys.stderr)
        return _exec(argv)


def enabled() -> bool:
    return (os.environ.get("LAYERTUNE_WARM", "1") != "0" and hasattr(os, "fork") and hasattr(socket, "send_fds")
            and hasattr(socket, "SO_PEERCRED"))


def _exec(argv: list[str]) -> int:
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        print(f"pipelines.warm: no command {argv[0]!r}", file=sys.stderr)
        return 127


def socket_path() -> Path:
    """One server per project folder, interpreter and import-time environment, in this user's private folder."""
    identity = [os.getcwd(), sys.executable,
                sorted((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV))]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    name = f"layertune-warm-{digest}.sock"
    path = private_folder() / name
    if len(str(path)) > MAX_SOCKET_PATH:  # the limit of a Unix socket's address
        path = private_folder_at(_temp_folder()) / name
    return path


def private_folder() -> Path:
    """``LAYERTUNE_WARM_DIR`` if set, else ``layertune-warm`` in $XDG_RUNTIME_DIR when that is this user's and
    private, else ``layertune-warm-<uid>`` in the temp folder; created with mode 0700 and checked (`private_folder_at`)."""
    if override := os.environ.get("LAYERTUNE_WARM_DIR"):
        return private_folder_at(Path(override))
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _is_private(runtime):
        return private_folder_at(Path(runtime) / "layertune-warm")
    return private_folder_at(_temp_folder())


def _temp_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"layertune-warm-{os.getuid()}"


def _is_private(folder: str) -> bool:
    with contextlib.suppress(OSError):
        info = os.stat(folder)
        return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return False


def private_folder_at(folder: Path) -> Path:
    """``folder``, created if missing; Unavailable unless it is a real folder (not a symbolic link) of this user
    that nobody else may enter: in a shared temp folder anyone may have created that name first."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as error:
        raise Unavailable(f"cannot create the private folder {folder}: {error}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a folder"
        raise Unavailable(f"{folder} is {what}, not a private folder of this user")
    if info.st_uid != os.getuid():
        raise Unavailable(f"{folder} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})")
    if info.st_mode & 0o077:
        raise Unavailable(f"{folder} has mode {info.st_mode & 0o777:04o}; it must be private to its user (0700)")
    return folder


def peer_credentials(connection: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel saw it (SO_PEERCRED)."""
    return PEERCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))


def check_peer(connection: socket.socket, where: object, uid: int | None = None) -> None:
    """Unavailable unless the process at the other end of ``connection`` runs as ``uid`` (this user's)."""
    expected = os.getuid() if uid is None else uid
    _, peer_uid, _ = peer_credentials(connection)
    if peer_uid != expected:
        raise Unavailable(f"{where} runs as uid {peer_uid}, not as this user (uid {expected})")


def call(argv: list[str]) -> int:
    """Run ``argv`` in a fork of the server (started if needed) and return its exit code."""
    path = socket_path()
    for _ in range(2):  # a stale server refuses once; the second try reaches a fresh one
        connection = _connect_or_start(path)
        umask = os.umask(0)
        os.umask(umask)
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}
        try:
            socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
            reply = _receive(connection)  # {"started": pid}, or {"stale": true} from a server about to go
        except OSError as error:  # a server going away (its own caller was killed) took nothing: run it directly
            raise Unavailable(f"the server closed the connection before taking the request ({error})") from None
        if reply.get("stale"):
            connection.close()
            _wait_gone(path)
            continue
        if "started" not in reply:
            raise Unavailable("the server did not take the request")
        return _wait_for_exit(connection)
    raise Unavailable("the server kept refusing the request as stale")


def _connect(path: Path) -> socket.socket | None:
    """A connection to this user's server at ``path``; None if nobody listens there."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(str(path))
    except OSError:
        connection.close()
        return None
    try:
        check_peer(connection, f"the server at {path}")  # before anything is sent: argv, environment, streams
    except BaseException:
        connection.close()
        raise
    return connection


def _connect_or_start(path: Path) -> socket.socket:
    connection = _connect(path)
    if connection is not None:
        return connection
    with _start_lock(path):  # one caller starts the server; the others wait for it here
        connection = _connect(path)
        if connection is not None:
            return connection
        _remove_dead_socket(path)
        return _start_server(path)


@contextlib.contextmanager
def _start_lock(path: Path):
    """The lock beside the socket (0600), never opened through a symbolic link (filelock opens with O_NOFOLLOW)."""
    from filelock import FileLock  # only when a server must start: a call itself stays quick

    name = f"{path}.lock"
    try:
        lock = FileLock(name, mode=0o600).acquire()
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise Unavailable(f"{name} is a symbolic link; refusing to open it") from None
        raise Unavailable(f"cannot open {name}: {error}") from None
    with lock:
        yield


def _start_server(path: Path) -> socket.socket:
    log = _open_private(f"{path}.log", os.O_WRONLY | os.O_APPEND)
    try:
        server = subprocess.Popen([sys.executable, "-m", "pipelines.warm", "--serve", str(path)],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                  close_fds=True)
    finally:
        os.close(log)
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


def _open_private(name: str, flags: int) -> int:
    """A file descriptor for ``name`` (created 0600), never truncated and never through a symbolic link."""
    try:
        return os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise Unavailable(f"{name} is a symbolic link; refusing to open it") from None
        raise Unavailable(f"cannot open {name}: {error}") from None


def _remove_dead_socket(path: Path) -> None:
    """Remove the socket of a server that died, if it is this user's socket; anything else stays."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        raise Unavailable(f"{path} is not a socket of this user; leaving it in place")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


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

    with on_signals(forward):
        while True:
            reply = _receive(connection)
            if not reply:
                print("pipelines.warm: the server went away before the command finished", file=sys.stderr)
                return 1
            if "exit" in reply:
                return int(reply["exit"])


# ------------------------------------------------------------------------------------------------------- server


def serve(path: Path) -> int:
    """Import, listen on ``path``, fork one child per request; stop accepting when idle or when the code went
    stale, and exit once every child has reported back."""
    import threading

    _load_project_from_current_source()
    preload = os.environ.get("LAYERTUNE_WARM_PRELOAD")
    for module in PRELOAD if preload is None else [m for m in preload.split(",") if m]:
        with contextlib.suppress(Exception):  # a missing optional module is imported (and fails) in the command
            __import__(module)
    _import_project()
    if threading.active_count() > 1:  # forking a process with threads can deadlock its children
        print(f"pipelines.warm: {threading.active_count()} threads after imports", file=sys.stderr)
    watched = _Watched()
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


# The hash of the source each project module was compiled from, by file (filled by _SourceLoader).
_COMPILED: dict[str, bytes] = {}


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """Runs a module's current source: its cached .pyc only when that records the hash of this very source (a
    checked hash-based .pyc, PEP 552; written here), never one trusted by mtime and size; and records the hash."""

    def get_code(self, fullname):
        source = self.get_data(self.path)
        _COMPILED[os.path.abspath(self.path)] = _digest(source)
        header = importlib.util.MAGIC_NUMBER + (0b11).to_bytes(4, "little") + importlib.util.source_hash(source)
        try:
            cache = importlib.util.cache_from_source(self.path)
        except NotImplementedError:  # an interpreter without bytecode caching
            cache = None
        with contextlib.suppress(OSError, EOFError, ValueError, TypeError):  # none yet, or not readable
            data = self.get_data(cache) if cache else b""
            if data[:16] == header:
                return marshal.loads(data[16:])
        code = self.source_to_code(source, self.path)
        if cache and not sys.dont_write_bytecode:
            self.set_data(cache, header + marshal.dumps(code))  # ignores a folder it cannot write to
        return code


class _ProjectFinder:
    """Python's own path finder, with the project's modules loaded by `_SourceLoader`."""

    def __init__(self, is_project) -> None:
        self.is_project = is_project

    def find_spec(self, fullname, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if (spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader
                and self.is_project(spec.origin)):
            spec.loader = _SourceLoader(fullname, spec.origin)
        return spec

    def invalidate_caches(self) -> None:  # PathFinder itself is still on sys.meta_path and does this
        pass


def _load_project_from_current_source() -> None:
    """Put `_ProjectFinder` before Python's path finder: taking its place, it costs no second look-up."""
    finder = _ProjectFinder(_project_files())
    position = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder),
                    len(sys.meta_path))
    sys.meta_path.insert(position, finder)


def _project_files():
    """A test: is a file one of the project's own (layertune's, or the working folder's outside the installed
    packages, which a virtual environment inside the project holds)? Compares path strings: no system call per
    import."""
    import sysconfig

    paths = sysconfig.get_paths()
    own = _with_sep(os.path.dirname(os.path.realpath(__file__)))
    folder = _with_sep(os.getcwd())
    installed = tuple(_with_sep(os.path.realpath(p)) for p in {
        paths["purelib"], paths["platlib"], paths["stdlib"], paths["platstdlib"],
        sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix})

    def is_project(file: str | None) -> bool:
        if not file:
            return False
        file = os.path.abspath(file)
        return file.startswith(own) or (file.startswith(folder) and not file.startswith(installed))

    return is_project


def _with_sep(folder: str) -> str:
    return folder.rstrip(os.sep) + os.sep


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _content(name: str) -> bytes | None:
    try:
        with open(name, "rb") as file:
            return _digest(file.read())
    except OSError:
        return None


def _stat(name: str) -> tuple[int, int]:
    try:
        info = os.stat(name)
        return info.st_mtime_ns, info.st_size
    except OSError:
        return (0, 0)


class _Watched:
    """What the server's code was built from: the hash of each project file (as compiled, or as read now for
    the few imported before `_ProjectFinder`), and (mtime, size) of every other imported file and of the folders
    packages are installed in (installing or removing one changes them)."""

    def __init__(self) -> None:
        import sysconfig

        is_project = _project_files()
        files = {os.path.abspath(source) for module in list(sys.modules.values())
                 if isinstance(source := getattr(module, "__file__", None), str)}
        self.hashes = {name: _COMPILED.get(name) or _content(name) for name in sorted(files) if is_project(name)}
        installed = (files - self.hashes.keys()) | {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        self.stamps = {name: _stat(name) for name in sorted(installed)}

    def changed(self) -> str | None:
        """The first file that changed since the server imported it, or None."""
        for name, digest in self.hashes.items():
            if _content(name) != digest:
                return name
        return next((name for name, stamp in self.stamps.items() if _stat(name) != stamp), None)


def _accept(connection, watched, selector, children) -> bool:
    """Fork a child for the request on ``connection``; False (and the request refused) when the imported code
    changed since the server started."""
    try:
        check_peer(connection, "a caller")  # the socket's mode already keeps others out; root is not kept out
    except Unavailable as error:
        print(f"pipelines.warm: {error}; refused", file=sys.stderr, flush=True)
        connection.close()
        return True
    data, fds, _, _ = socket.recv_fds(connection, MESSAGE, 3)
    if not data:  # connected and went away without a request
        for fd in fds:
            os.close(fd)
        connection.close()
        return True
    request = json.loads(data)
    if (changed := watched.changed()) is not None:
        print(f"pipelines.warm: {changed} changed since it was imported; this server stops", file=sys.stderr,
              flush=True)
        connection.send(json.dumps({"stale": True}).encode())
        for fd in fds:
            os.close(fd)
        connection.close()
        return False
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        for key in list(selector.get_map().values()):  # the listener and other callers' connections: not ours
            key.fileobj.close()
        selector.close()
        _child(request, fds, connection, server)  # never returns
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


def _child(request: dict, fds: list[int], connection: socket.socket, server: int) -> None:
    """In the fork: become the caller's process (folder, environment, streams, arguments), run, exit. It ends with
    the server too (SIGTERM when the server exits, even by SIGKILL): no command runs on, orphaned."""
    code = 1
    try:
        die_with_parent(signal.SIGTERM, server)
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
        print(f"pipelines.warm: {argv[0]!r} is not a console script of this environment", file=sys.stderr)
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
    """Exit as Python would (atexit handlers, flushed streams): SystemExit leaves through the server's frames, which
    catch nothing, to the interpreter's own exit."""
    raise SystemExit(code)


if __name__ == "__main__":
    sys.exit(main())
