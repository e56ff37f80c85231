"""The warm worker runs a command as if it were started directly: arguments, folder, environment, streams, exit
code and signals; it never runs stale code, a dead caller stops its command, and no other user can stand in for
its server or make it write through a planted link."""

import contextlib
import json
import os
import py_compile
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from pipelines import warm as warm_module

NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user needs root")

HELPER = '''
import os, signal, sys, time
from pathlib import Path
VERSION = 1
def stop(signum, frame):
    Path("stopped").write_text(str(signum)); sys.exit(143)
signal.signal(signal.SIGTERM, stop)
command = sys.argv[1]
if command == "show":
    print(f"version={VERSION} cwd={Path.cwd().name} arg={sys.argv[2]} var={os.environ.get('HELPER_VAR')} pid={os.getpid()}")
    sys.stderr.write("to stderr\\n")
    sys.exit(int(sys.argv[3]))
if command == "wait":
    print("waiting", flush=True); time.sleep(60)
if command == "late":  # a module the server never imported
    import late; print(f"late={late.VALUE}")
'''

# Binds the path as root, then listens as nobody (a caller sees the credentials of listen()); prints what it got.
FOREIGN_LISTENER = '''
import json, os, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
os.setgid(65534)
os.setuid(65534)
listener.listen(1)
listener.settimeout(30)
print("listening", flush=True)
connection, _ = listener.accept()
connection.settimeout(10)
data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
print(json.dumps({"data": data.decode(errors="replace"), "fds": len(fds)}), flush=True)
'''


@pytest.fixture
def project(monkeypatch):
    """A folder with a helper module the server preloads (so it watches it), also its socket folder (private, as
    mkdtemp makes it; short: a socket's path has at most about 100 characters)."""
    tmp_path = Path(tempfile.mkdtemp(prefix="lw-"))
    (tmp_path / "helper.py").write_text(HELPER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERTUNE_WARM_DIR", str(tmp_path))
    monkeypatch.setenv("LAYERTUNE_WARM_PRELOAD", "helper")
    monkeypatch.setenv("LAYERTUNE_WARM_IDLE", "20")
    root = Path(__file__).parents[1]  # this checkout's library and pipelines, whatever is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(root / "src"), str(root)]))
    yield tmp_path
    for path in tmp_path.glob("layertune-warm-*.sock"):  # stop this test's servers, found by their sockets
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.connect(str(path))
            # SIGKILL: the server imported helper, whose SIGTERM handler would write into the folder being removed
            os.kill(warm_module.peer_credentials(probe)[0], signal.SIGKILL)
    shutil.rmtree(tmp_path, ignore_errors=True)


def warm(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.warm", sys.executable, "-m", "helper", *args],
                          capture_output=True, text=True, timeout=60, **kwargs)


def test_runs_like_the_command_itself(project, monkeypatch):
    monkeypatch.setenv("HELPER_VAR", "from the caller")
    (project / "sub").mkdir()
    first = warm("show", "a b", "3", cwd=project / "sub")
    assert first.returncode == 3
    assert "cwd=sub arg=a b var=from the caller" in first.stdout and "to stderr" in first.stderr
    second = warm("show", "x", "0", cwd=project / "sub")
    assert second.returncode == 0 and "arg=x" in second.stdout
    assert first.stdout.split("pid=")[1] != second.stdout.split("pid=")[1]  # a fresh fork each time
    assert len(list(project.glob("layertune-warm-*.sock"))) == 1  # ... of one server (per folder)
    monkeypatch.setenv("LAYERTUNE_WARM", "0")
    assert warm("show", "direct", "5").returncode == 5


def test_changed_code_is_never_run_stale(project):
    assert "version=1" in warm("show", "-", "0").stdout
    time.sleep(0.01)
    (project / "helper.py").write_text(HELPER.replace("VERSION = 1", "VERSION = 2"))
    assert "version=2" in warm("show", "-", "0").stdout


def test_sigterm_reaches_the_command(project):
    warm("show", "-", "0")  # the server is up
    caller = subprocess.Popen([sys.executable, "-m", "pipelines.warm", sys.executable, "-m", "helper", "wait"],
                              stdout=subprocess.PIPE, text=True)
    assert caller.stdout.readline().strip() == "waiting"
    caller.send_signal(signal.SIGTERM)
    assert caller.wait(timeout=30) == 143
    assert (project / "stopped").read_text() == str(int(signal.SIGTERM))


def test_a_killed_caller_stops_its_command(project):
    warm("show", "-", "0")
    caller = subprocess.Popen([sys.executable, "-m", "pipelines.warm", sys.executable, "-m", "helper", "wait"],
                              stdout=subprocess.PIPE, text=True)
    assert caller.stdout.readline().strip() == "waiting"
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 30
    while not (project / "stopped").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (project / "stopped").read_text() == str(int(signal.SIGTERM))


def wait_stopped(project: Path, timeout_s: float = 30.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while not (project / "stopped").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return (project / "stopped").read_text() if (project / "stopped").exists() else None


def test_a_caller_whose_parent_is_killed_stops_its_command(project):
    """`kill -9` of what started the call (`dvc repro`): the caller gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
    and passes it on, so the command ends instead of training on, re-parented to init."""
    warm("show", "-", "0")
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys
        caller = subprocess.Popen([sys.executable, "-m", "pipelines.warm", sys.executable, "-m", "helper", "wait"])
        caller.wait()
    """)], stdout=subprocess.PIPE, text=True)
    assert starter.stdout.readline().strip() == "waiting"
    starter.kill()
    starter.wait()
    assert wait_stopped(project) == str(int(signal.SIGTERM))


def test_a_killed_server_stops_the_commands_it_runs(project):
    warm("show", "-", "0")
    caller = subprocess.Popen([sys.executable, "-m", "pipelines.warm", sys.executable, "-m", "helper", "wait"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert caller.stdout.readline().strip() == "waiting"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.connect(str(warm_module.socket_path()))
        os.kill(warm_module.peer_credentials(probe)[0], signal.SIGKILL)
    assert wait_stopped(project) == str(int(signal.SIGTERM))  # the fork got SIGTERM as its parent died
    assert caller.wait(timeout=30) == 1 and "the server went away" in caller.stderr.read()


def test_callers_at_once_share_one_server(project):
    callers = [subprocess.Popen([sys.executable, "-m", "pipelines.warm", sys.executable, "-m", "helper", "show",
                                 str(i), "0"], stdout=subprocess.PIPE, text=True) for i in range(4)]
    outputs = [caller.communicate(timeout=60)[0] for caller in callers]
    assert [caller.returncode for caller in callers] == [0, 0, 0, 0]
    assert all(f"arg={i}" in output for i, output in enumerate(outputs))
    assert len(list(project.glob("layertune-warm-*.sock"))) == 1


def test_sockets_are_private_to_their_user(project):
    warm("show", "-", "0")
    socket_file = next(project.glob("layertune-warm-*.sock"))
    assert socket_file.stat().st_mode & 0o777 == 0o600


@needs_root
def test_a_listener_of_another_user_is_sent_nothing(project, monkeypatch):
    monkeypatch.setenv("HELPER_VAR", "secret-token")
    path = warm_module.socket_path()
    listener = subprocess.Popen([sys.executable, "-c", FOREIGN_LISTENER, str(path)], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert listener.stdout.readline().strip() == "listening"
        result = warm("show", "a", "4")
        received = json.loads(listener.stdout.readline())
    finally:
        listener.kill()
        listener.wait()
    assert received == {"data": "", "fds": 0}  # it was reached, and refused before anything was sent
    assert f"the server at {path} runs as uid {NOBODY}, not as this user (uid 0)" in result.stderr
    assert result.returncode == 4 and "arg=a var=secret-token" in result.stdout  # the command ran directly
    assert path.is_socket() and not Path(f"{path}.log").exists()  # not ours, left alone; no server started


def test_the_peer_check_compares_the_kernels_credentials():
    first, second = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with first, second:
        assert warm_module.peer_credentials(first) == (os.getpid(), os.getuid(), os.getgid())
        warm_module.check_peer(first, "the pair")
        with pytest.raises(warm_module.Unavailable,
                           match=rf"the pair runs as uid {os.getuid()}, not as this user \(uid {os.getuid() + 1}\)"):
            warm_module.check_peer(first, "the pair", uid=os.getuid() + 1)


def test_the_server_refuses_a_caller_of_another_user(monkeypatch):
    server_end, caller = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with server_end, caller:
        request = {"argv": ["touch", "ran"], "cwd": os.getcwd(), "env": {}, "umask": 0o022}
        socket.send_fds(caller, [json.dumps(request).encode()], [0, 1, 2])
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # the server runs as another user than its caller
        children = {}
        assert warm_module._accept(server_end, None, None, children)  # refused, and still serving others
        monkeypatch.undo()
        assert children == {}  # no command forked
        with pytest.raises(ConnectionResetError):  # the connection closed unanswered, its request unread
            caller.recv(100)


def test_a_planted_lock_link_is_never_followed(project):
    path = warm_module.socket_path()
    lock = Path(f"{path}.lock")
    victim = project / "victim.txt"
    victim.write_text("precious")
    lock.symlink_to(victim)
    result = warm("show", "-", "0")
    assert result.returncode == 0 and "version=1" in result.stdout  # run directly
    assert f"{lock} is a symbolic link; refusing to open it" in result.stderr
    assert victim.read_text() == "precious" and lock.is_symlink()
    lock.unlink()
    lock.symlink_to(project / "created")  # a dangling link: following it would create the file
    assert warm("show", "-", "0").returncode == 0
    assert not (project / "created").exists()


@pytest.mark.parametrize("flaw, message", [
    ("open to others", "has mode 0755; it must be private to its user (0700)"),
    pytest.param("another user's", f"belongs to uid {NOBODY}, not to this user", marks=needs_root),
    ("a symbolic link", "is a symbolic link, not a private folder of this user"),
])
def test_a_socket_folder_that_is_not_private_is_refused(project, monkeypatch, flaw, message):
    folder = project / "sockets"
    if flaw == "a symbolic link":
        (project / "real").mkdir(mode=0o700)
        folder.symlink_to(project / "real")
    else:
        folder.mkdir(mode=0o700)
        if flaw == "open to others":
            folder.chmod(0o755)
        else:
            os.chown(folder, NOBODY, NOBODY)
    monkeypatch.setenv("LAYERTUNE_WARM_DIR", str(folder))
    with pytest.raises(warm_module.Unavailable, match=message.replace("(", r"\(").replace(")", r"\)")):
        warm_module.socket_path()
    result = warm("show", "-", "0")
    assert result.returncode == 0 and "version=1" in result.stdout
    assert result.stderr.startswith(f"pipelines.warm: {folder} {message}") and "running the command directly" \
        in result.stderr
    assert not list(folder.iterdir())


def test_the_default_folder_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv("LAYERTUNE_WARM_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    folder = warm_module.private_folder()
    assert folder == tmp_path / f"layertune-warm-{os.getuid()}"  # a runtime folder open to others is passed over
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    runtime.chmod(0o700)
    assert warm_module.private_folder() == runtime / "layertune-warm"
    assert stat.S_IMODE(os.lstat(runtime / "layertune-warm").st_mode) == 0o700


def test_an_edit_that_keeps_size_and_mtime_is_seen(project):
    helper = project / "helper.py"
    py_compile.compile(str(helper))  # a cached .pyc, which Python trusts while the source's mtime and size match
    assert "version=1" in warm("show", "-", "0").stdout
    before = helper.stat()
    helper.write_text(HELPER.replace("VERSION = 1", "VERSION = 2"))
    os.utime(helper, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (helper.stat().st_size, helper.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert "version=2" in warm("show", "-", "0").stdout
    log = Path(f"{warm_module.socket_path()}.log").read_text()
    assert f"{helper} changed since it was imported" in log


def test_a_module_first_imported_by_the_command_is_fresh_too(project):
    late = project / "late.py"
    late.write_text("VALUE = 1\n")
    py_compile.compile(str(late))
    assert "late=1" in warm("late").stdout
    before = late.stat()
    late.write_text("VALUE = 2\n")
    os.utime(late, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert "late=2" in warm("late").stdout
