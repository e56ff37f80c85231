"""A team's MLflow server, for tests: PostgreSQL (Debian's `postgresql` package) as the backend store and a folder as
the artifact store, both private to the test and on 127.0.0.1; the same `mlflow server` command docs/pipeline.md
gives ("Scaling out"), with a private database cluster instead of the team's.

    python -m tests.team_server <command> [args...]   runs the command with MLFLOW_TRACKING_URI set to the server
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

DATABASE, USER = "mlflow", "mlflow"


def postgres_bin() -> Path:
    """The folder of PostgreSQL's server programs (initdb, pg_ctl): on PATH, or where Debian installs them."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / "initdb").exists():
            return Path(folder)
    raise RuntimeError("PostgreSQL is not installed (no initdb): apt-get install postgresql (.ci/run does this)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as the `postgres` user the package creates."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A new PostgreSQL cluster on 127.0.0.1 with an empty database for MLflow; yields its SQLAlchemy URI."""
    bin_dir, port = postgres_bin(), free_port()
    folder = Path(tempfile.mkdtemp(prefix="layertune-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    data, log = folder / "data", folder / "server.log"
    run = lambda *command: subprocess.run(_as_postgres([str(c) for c in command]), check=True,  # noqa: E731
                                          capture_output=True, text=True)
    try:
        run(bin_dir / "initdb", "--auth=trust", f"--username={USER}", "--encoding=UTF8", "-D", data)
        run(bin_dir / "pg_ctl", "start", "--wait", "-D", data, "-l", log,
            "-o", f"-h 127.0.0.1 -p {port} -k {folder} -F")  # -F: no fsync, a throwaway cluster
        run(bin_dir / "createdb", "-h", "127.0.0.1", "-p", port, "-U", USER, DATABASE)
        yield f"postgresql://{USER}@127.0.0.1:{port}/{DATABASE}"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(_as_postgres([str(bin_dir / "pg_ctl"), "stop", "-D", str(data), "-m", "fast"]),
                           capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, artifacts: Path, port: int | None = None) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 (``port``, else a free one) over ``backend_store_uri``, serving artifacts from
    ``artifacts``; yields its URL once it answers."""
    port = port or free_port()
    command = ["mlflow", "server", "--backend-store-uri", backend_store_uri, "--artifacts-destination",
               str(artifacts), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"mlflow server did not start:\n{log.read().decode()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 15)
        server.wait(timeout=30)
        log.close()


@contextlib.contextmanager
def team_server() -> Iterator[str]:
    """PostgreSQL and an MLflow server over it; yields the tracking URI."""
    with postgres() as database, tempfile.TemporaryDirectory(prefix="layertune-artifacts-") as artifacts, \
            mlflow_server(database, Path(artifacts)) as url:
        yield url


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    with team_server() as url:
        print(f"team_server: MLflow at {url} (PostgreSQL backend)", file=sys.stderr, flush=True)
        return subprocess.run(argv, env={**os.environ, "MLFLOW_TRACKING_URI": url}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
