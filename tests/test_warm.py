"""The warm worker runs a command as if it were started directly: arguments, folder, environment, streams, exit
code and signals; it never runs stale code, and a dead caller stops its command."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

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
'''


@pytest.fixture
def project(monkeypatch):
    """A folder with a helper module the server preloads (so it watches it), also its socket folder (short: a
    socket's path has at most about 100 characters)."""
    tmp_path = Path(tempfile.mkdtemp(prefix="lw-"))
    (tmp_path / "helper.py").write_text(HELPER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERTUNE_WARM_DIR", str(tmp_path))
    monkeypatch.setenv("LAYERTUNE_WARM_PRELOAD", "helper")
    monkeypatch.setenv("LAYERTUNE_WARM_IDLE", "20")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(Path(__file__).parents[1] / "src")]))
    yield tmp_path
    subprocess.run(["pkill", "-f", f"layertune.warm --serve {tmp_path}"], check=False)
    shutil.rmtree(tmp_path, ignore_errors=True)


def warm(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layertune.warm", sys.executable, "-m", "helper", *args],
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
    caller = subprocess.Popen([sys.executable, "-m", "layertune.warm", sys.executable, "-m", "helper", "wait"],
                              stdout=subprocess.PIPE, text=True)
    assert caller.stdout.readline().strip() == "waiting"
    caller.send_signal(signal.SIGTERM)
    assert caller.wait(timeout=30) == 143
    assert (project / "stopped").read_text() == str(int(signal.SIGTERM))


def test_a_killed_caller_stops_its_command(project):
    warm("show", "-", "0")
    caller = subprocess.Popen([sys.executable, "-m", "layertune.warm", sys.executable, "-m", "helper", "wait"],
                              stdout=subprocess.PIPE, text=True)
    assert caller.stdout.readline().strip() == "waiting"
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 30
    while not (project / "stopped").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (project / "stopped").read_text() == str(int(signal.SIGTERM))


def test_callers_at_once_share_one_server(project):
    callers = [subprocess.Popen([sys.executable, "-m", "layertune.warm", sys.executable, "-m", "helper", "show",
                                 str(i), "0"], stdout=subprocess.PIPE, text=True) for i in range(4)]
    outputs = [caller.communicate(timeout=60)[0] for caller in callers]
    assert [caller.returncode for caller in callers] == [0, 0, 0, 0]
    assert all(f"arg={i}" in output for i, output in enumerate(outputs))
    assert len(list(project.glob("layertune-warm-*.sock"))) == 1


def test_sockets_are_private_to_their_user(project):
    warm("show", "-", "0")
    socket_file = next(project.glob("layertune-warm-*.sock"))
    assert socket_file.stat().st_mode & 0o777 == 0o600
