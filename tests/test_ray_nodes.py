"""What `layertune repro --ray` does around a cell, without a Ray cluster: the build's gate (which cells are inside, so
that the driver removes the nodes' folders only once they have left), the cell's folder, a cleanup that a repeated
cancel cannot cut short, and the cluster's address checked before Ray is asked to connect to it."""

import _thread
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from pipelines import ray_cluster, ray_node
from tests.projects import ROOT


@pytest.fixture
def node_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"layertune-ray-{os.getuid()}"


def test_the_gate_lists_the_cells_inside_and_once_closed_lets_none_in():
    gate, one, two = ray_node.BuildGate(), PLACES["node-1"], PLACES["node-2"]
    assert gate.enter("train-s@a", "attempt-1", one) and gate.enter("train-s@b", "attempt-2", two)
    assert not gate.leave("attempt-1")  # the build goes on: the driver removes the folders at its end
    assert not gate.leave("never-entered")  # a task interrupted before its `enter` was taken still says it left
    assert gate.close(ALIVE) == [("train-s@b", two)]
    assert not gate.enter("train-s@c", "attempt-3", one)  # a task Ray started although it was cancelled
    assert gate.leave("attempt-2")  # last out of a closed build on its machine: removes the folder there
    assert gate.close(ALIVE) == []


def test_the_last_cell_to_leave_a_closed_gate_on_a_machine_is_told_so():
    """Two nodes on one machine share its temp folder: the first to leave must not remove the other's workspace."""
    gate = ray_node.BuildGate()
    for attempt, node in (("a", "node-1"), ("b", "node-2"), ("c", "node-3")):
        gate.enter(f"train-s@{attempt}", attempt, PLACES[node])
    gate.close(ALIVE)
    assert not gate.leave("a")  # node-2, on the same machine, is still inside
    assert gate.leave("c")  # alone on its machine
    assert gate.leave("b")


def test_a_closed_gate_forgets_cells_that_will_never_leave():
    gate = ray_node.BuildGate()
    gate.enter("train-s@a", "lost", PLACES["node-1"])  # its node is gone
    gate.enter("train-s@b", "dead-worker", PLACES["node-3"])  # its worker died; Ray's retry finished the cell
    gate.enter("train-s@c", "stopping", PLACES["node-3"])
    assert gate.close(["node-2", "node-3"], completed=["train-s@b"]) == [("train-s@c", PLACES["node-3"])]
    assert gate.leave("stopping")  # nobody else inside on gpu-2 any more


PLACES = {"node-1": ray_node.Place("node-1", "gpu-1"), "node-2": ray_node.Place("node-2", "gpu-1"),
          "node-3": ray_node.Place("node-3", "gpu-2")}
ALIVE = list(PLACES)


def test_a_cells_folder_is_in_its_builds_folder_and_goes_with_the_cell(node_tmp):
    with ray_node.cell_folder("build-1", "train-s@cell") as folder:
        assert folder.parent == node_tmp / "build-1" and folder.name.startswith("train-s-cell-")
        (folder / "run.json").write_text("{}")
    assert list((node_tmp / "build-1").iterdir()) == []
    ray_node.remove_build_folder("build-1")
    ray_node.remove_build_folder("never-here")
    assert list(node_tmp.iterdir()) == []


def test_each_cell_of_a_build_has_its_own_dvc_cache_even_where_the_project_names_a_shared_one(node_tmp, tmp_path):
    """DVC puts a pulled object in its cache in place (created empty, then filled), so two cells pulling into one
    cache can check out an empty file: CI saw a 0-byte dev.parquet. Each workspace gets a cache of its own."""
    from dvc.repo import Repo

    repository = tmp_path / "repository"
    subprocess.run(["git", "init", "--quiet", str(repository)], check=True)
    (repository / ".dvc").mkdir()
    (repository / ".dvc" / "config").write_text(f"[cache]\n    dir = {tmp_path / 'everyones-cache'}\n")
    subprocess.run(["git", "-C", str(repository), "add", "."], check=True)
    subprocess.run(["git", "-C", str(repository), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet",
                    "-m", "dvc"], check=True)
    commit = subprocess.run(["git", "-C", str(repository), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    workspace = ray_node.NodeWorkspace(repository=str(repository), commit=commit, dvc_lock="",
                                       remote_config="[core]\n    remote = r\n['remote \"r\"']\n    url = /r\n",
                                       inputs={}, build="build-1", env={})
    caches = []
    for stage in ("train-s@a", "train-s@b"):
        with ray_node.cell_folder("build-1", stage) as folder:
            workspace.prepare(folder)
            with Repo(str(folder)) as repo:
                caches.append(repo.cache.local.path)
                assert repo.config["core"]["remote"] == "r"
            assert (folder / "data" / "cache").resolve() == (node_tmp / "build-1" / "feature-cache").resolve()
    assert caches[0] != caches[1]
    assert all(cache.startswith(str(node_tmp / "build-1")) for cache in caches)


def test_a_cells_cleanup_runs_to_its_end_through_another_cancel():
    """Ray may deliver a cancel (KeyboardInterrupt in the task's thread) again while the cell stops its commands."""
    ended = []

    def cleanup() -> None:
        time.sleep(1.0)
        ended.append(True)

    threading.Timer(0.3, _thread.interrupt_main).start()
    ray_node._to_the_end(cleanup)
    assert ended == [True]


def test_a_cell_that_leaves_a_closed_build_last_on_its_machine_removes_the_builds_folder(node_tmp, monkeypatch):
    """The driver waits a while for cancelled cells, then removes the folders; a cell still starting then (a loaded
    machine) writes into its build's folder after that, and removes it itself as it leaves."""
    import ray

    class Actor:  # the gate as a Ray actor handle: `gate.leave.remote(...)` gives what `ray.get` returns
        def __init__(self, gate):
            self.leave = type("Method", (), {"remote": staticmethod(gate.leave)})

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    gate = ray_node.BuildGate()
    for attempt in ("late", "other"):
        gate.enter("train-s@a", attempt, PLACES["node-1"])
    with ray_node.cell_folder("build-1", "train-s@a") as folder:
        (folder.parent / "dvc-cache").mkdir()
    gate.close(ALIVE)
    ray_node._leave(Actor(gate), "other", "build-1")
    assert (node_tmp / "build-1" / "dvc-cache").is_dir()  # "late" is still inside on this machine
    ray_node._leave(Actor(gate), "late", "build-1")
    assert list(node_tmp.iterdir()) == []


def test_a_running_cell_stops_its_command_once_the_driver_has_closed_the_gate(monkeypatch):
    """Under load Ray was seen not to deliver a cancel to a running cell (the build then waited minutes for cells
    that trained on): the driver closes the gate before it cancels, and a running cell that finds it closed stops."""
    import ray

    from pipelines.parallel import Children

    class Actor:  # the gate as a Ray actor handle: `gate.is_open.remote()` is what `ray.get` returns
        def __init__(self, gate):
            self.is_open = type("Method", (), {"remote": staticmethod(gate.is_open)})

    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (refs, []))
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(ray_node, "GATE_POLL_S", 0.1)
    gate, children = ray_node.BuildGate(), Children(grace_s=5.0)
    watch = ray_node._GateWatch(Actor(gate))
    threading.Timer(1.0, gate.close, [ALIVE]).start()
    started = time.monotonic()
    done = ray_node._interruptible(watch.build_ended, children.run,
                                   [sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    assert done is None and 1.0 <= time.monotonic() - started < 5.0
    children.stop()
    assert time.monotonic() - started < 10.0


@pytest.mark.parametrize("error, ended", [("ActorDiedError", True), ("ActorUnavailableError", False)])
def test_a_cell_whose_gate_is_gone_stops_and_one_whose_gate_is_slow_goes_on(monkeypatch, error, ended):
    """The gate dies with the driver (or its node): nobody is left to collect the cell, which stops. A gate only
    unavailable for now (a loaded driver node) is asked again: a healthy cell must not fail the build."""
    import ray

    class Gate:
        class is_open:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote():
                return "ref"

    def get(value, timeout=None):
        raise (ray.exceptions.ActorDiedError() if error == "ActorDiedError"
               else ray.exceptions.ActorUnavailableError("the driver's node is busy", None))

    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (refs, []))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray_node, "GATE_POLL_S", 0.0)
    watch = ray_node._GateWatch(Gate())
    assert not watch.build_ended()  # asked, no answer read yet
    assert watch.build_ended() is ended


def test_the_watcher_stops_a_cells_commands_once_its_worker_is_gone():
    """A node lost (the worker killed with SIGKILL): the detached watcher sees it (psutil) and ends the cell's process
    group, so no cell trains on beside its retry."""
    import subprocess
    import sys

    import psutil

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    cell = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    subprocess.run([sys.executable, "-c", ray_node._WATCHER, str(worker.pid), str(cell.pid)], check=True,
                   start_new_session=True)
    time.sleep(1.0)
    assert cell.poll() is None  # the worker lives: the cell goes on
    worker.kill()  # left a zombie until reaped: the watcher must not count it alive
    deadline = time.monotonic() + 15
    while cell.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    worker.wait()
    assert cell.returncode == -15  # SIGTERM: its run ends KILLED
    assert not psutil.pid_exists(cell.pid)
@pytest.mark.parametrize("option, env", [(["--ray", "127.0.0.1:1"], {}), (["--ray"], {"RAY_ADDRESS": "127.0.0.1:1"}),
                                         (["--ray", "auto"], {"RAY_ADDRESS": "127.0.0.1:1"})])
def test_a_ray_address_nobody_answers_at_is_a_one_line_error_at_once(tmp_path, option, env):
    """Ray's own connect retries an unreachable address for minutes, printing warnings that name another address."""
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text("studies: {ablation: {}}\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pipelines.repro", *option], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"})
    assert time.monotonic() - started < 30
    assert done.returncode == 2, done.stdout + done.stderr
    given = "$RAY_ADDRESS=127.0.0.1:1" if env else "--ray 127.0.0.1:1"
    assert done.stderr.splitlines() == [f"layertune repro: {given}: no Ray cluster reachable at 127.0.0.1:1 "
                                        "(connection refused); check the address, and that the head runs "
                                        "(ray start --head) with its port open to this machine"]


@pytest.fixture
def server():
    """A TCP server on a free local port that sends ``reply`` to each connection (None: stays silent); its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    replies: list = []

    def serve() -> None:
        with listener:
            while True:
                try:
                    connection, _ = listener.accept()
                except OSError:
                    return
                if replies[0] is not None:
                    connection.sendall(replies[0])
                time.sleep(2)
                connection.close()

    def start(reply: bytes | None) -> str:
        replies.append(reply)
        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{listener.getsockname()[1]}"

    yield start
    listener.close()


SETTINGS = bytes([0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 100])  # an HTTP/2 server's first frame, as gRPC's


@pytest.mark.parametrize("reply, reason", [(None, "no answer within 1 s"),
                                           (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not as a Ray cluster does")])
def test_an_address_where_something_else_listens_is_refused(server, monkeypatch, reply, reason):
    monkeypatch.setattr(ray_cluster, "CONNECT_TIMEOUT_S", 1.0)
    address = server(reply)
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"^--ray {address}: no Ray cluster reachable at {address} \\(.*{reason}"):
        ray_cluster.check_reachable(address)
    assert time.monotonic() - started < 2


def test_an_address_where_a_grpc_server_answers_passes(server, monkeypatch):
    address = server(SETTINGS)
    ray_cluster.check_reachable(address)
    ray_cluster.check_reachable(f"ray://{address}")
    monkeypatch.setenv("RAY_ADDRESS", address)
    ray_cluster.check_reachable(None)
    ray_cluster.check_reachable("auto")
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(socket, "create_connection", None)  # Ray looks on this machine itself: nothing to check
    for address in (None, "auto", "local"):
        ray_cluster.check_reachable(address)


@pytest.mark.parametrize("address, endpoint", [("head:6379", ("head", 6379)), ("ray://head", ("head", 10001)),
                                               ("ray://head:7000", ("head", 7000)), ("[::1]:6379", ("::1", 6379))])
def test_a_ray_address_names_its_endpoint(address, endpoint):
    assert ray_cluster.cluster_endpoint(address, f"--ray {address}") == endpoint


@pytest.mark.parametrize("address", ["head", "head:port", "ray://"])
def test_a_ray_address_of_another_form_is_refused_with_the_forms(address):
    with pytest.raises(ValueError, match=f"^--ray {address}: a Ray address is HOST:PORT .*, auto or local$"):
        ray_cluster.check_reachable(address)
