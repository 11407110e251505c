"""Sweeps on a real PostgreSQL server, started by the test: initdb and postgres from Debian's package in a
temporary directory, on 127.0.0.1 and a free port, as the ``postgres`` user (or ``nobody``) when the test
runs as root (the server refuses root). Two worker processes share one study; one is killed with SIGKILL
in the middle of a trial; the study completes its count exactly. Skipped, with the reason, when no server
binary or no driver is installed (``apt-get install postgresql``; ``pip install 'tritune[postgres]'``)."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tritune.tuning import search

sys.path.insert(0, str(Path(__file__).resolve().parent))  # worker processes (spawn) inherit it
from tritune_sweep_helpers import own_user_store, two_workers_one_killed  # noqa: E402,F401 (autouse fixture)


def _bindir() -> str | None:
    cands = []
    if shutil.which("pg_config"):
        try:
            cands.append(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                                        timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    cands += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    cands += [os.path.dirname(p) for p in (shutil.which("initdb"), shutil.which("postgres")) if p]
    for d in cands:
        if d and os.path.exists(os.path.join(d, "initdb")) and os.path.exists(os.path.join(d, "postgres")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_user():
    """(preexec_fn, uid, gid): drop root for the server, which refuses to run as root."""
    if os.geteuid() != 0:
        return None, None, None
    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue

        def drop(pw=pw):
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
        return drop, pw.pw_uid, pw.pw_gid
    return False, None, None


@pytest.fixture(scope="module")
def postgres_url():
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binary (initdb, postgres) found: apt-get install postgresql")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pytest.skip("no PostgreSQL driver: pip install 'tritune[postgres]' (psycopg2-binary)")
    drop, uid, gid = _as_user()
    if drop is False:
        pytest.skip("running as root and no unprivileged user (postgres, nobody) to run the server as")
    d = Path(tempfile.mkdtemp(prefix="tritune-pg-"))  # not under pytest's root-only tmp: the server user reads it
    if uid is not None:
        os.chown(d, uid, gid)
    data, port = d / "data", _free_port()
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    try:
        r = subprocess.run([f"{bindir}/initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync",
                            "-E", "UTF8"], capture_output=True, text=True, preexec_fn=drop, env=env, timeout=120)
        if r.returncode:
            pytest.fail(f"initdb failed: {r.stderr.strip()[-500:]}")
        server = subprocess.Popen(
            [f"{bindir}/postgres", "-D", str(data), "-p", str(port), "-k", str(d), "-c", "listen_addresses=127.0.0.1",
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
            stdout=subprocess.DEVNULL, stderr=open(d / "server.log", "w"), preexec_fn=drop, env=env)
        url = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
        import psycopg2

        t0 = time.time()
        while True:
            try:
                psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres").close()
                break
            except psycopg2.OperationalError:
                if server.poll() is not None or time.time() - t0 > 60:
                    pytest.fail(f"postgres did not start: {(d / 'server.log').read_text()[-500:]}")
                time.sleep(0.1)
        yield url
    finally:
        if "server" in locals():
            server.send_signal(signal.SIGINT)  # fast shutdown: the test process may still hold pooled connections
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        shutil.rmtree(d, ignore_errors=True)


def _fresh_db(url: str, name: str) -> str:
    import psycopg2

    base = url.split("://", 1)[1]
    host_port = base.split("@", 1)[1].split("/", 1)[0]
    host, port = host_port.split(":")
    conn = psycopg2.connect(host=host, port=int(port), user="postgres", dbname="postgres")
    conn.autocommit = True
    with conn.cursor() as c:
        c.execute(f"DROP DATABASE IF EXISTS {name}")
        c.execute(f"CREATE DATABASE {name}")
    conn.close()
    return url.rsplit("/", 1)[0] + "/" + name


def test_two_workers_on_postgres_one_killed(postgres_url, tmp_path, monkeypatch):
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("TRITUNE_TEST_MARKS", str(tmp_path / "marks"))
    two_workers_one_killed(_fresh_db(postgres_url, "sweep_kill"), tmp_path / "marks")


def test_storage_help_url_works(postgres_url):
    """The URL form --storage's help shows opens a study on the server."""
    assert "postgresql+psycopg2://USER@127.0.0.1:5432/DB" in search.STORAGE_HELP
    url = _fresh_db(postgres_url, "help_url")
    import optuna

    optuna.create_study(study_name="x", storage=search.open_storage(url))
    assert optuna.get_all_study_names(search.open_storage(url)) == ["x"]


def test_a_postgres_server_that_is_not_there_is_one_line(tmp_path):
    pytest.importorskip("psycopg2", reason="no PostgreSQL driver: pip install 'tritune[postgres]'")
    with pytest.raises(search.StorageError, match="cannot open it") as e:
        search.open_storage(f"postgresql+psycopg2://postgres@127.0.0.1:{_free_port()}/none")
    assert "\n" not in str(e.value)
