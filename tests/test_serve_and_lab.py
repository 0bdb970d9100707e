"""Serving and the lab as a user meets them: `make serve` / `python -m dflash_lab.vllm_engine`, `make lab`.

  the wrapper: SIGTERM, SIGINT and SIGHUP each stop every process it started (API
      server, engine core, ...), found by walking /proc, not only its process group;
      with vLLM itself for SIGTERM (and the README's example request returns text),
      with a stand-in server for all three (cheap)
  bad input: clear errors, no stray process, nothing written
  make: `make serve PORT=...` passes the port; `make lab` adds --allow-root only for root
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from dflash_lab.runtime import DRAFTER_ENV, REPO_ROOT, drafter_path
from dflash_lab.vllm_engine import EngineRun, VLLMEngineError, free_port, run_offline, serve
from dflash_lab.vllm_engine import server as server_module
from dflash_lab.vllm_engine.process import VLLM_VENV, VLLM_VENV_ENV, engine_env

needs_vllm = pytest.mark.skipif(not (VLLM_VENV / ".installed").is_file(), reason="needs .venv-vllm: run `make setup`")
READY = "vLLM serves"  # the wrapper's line once the server answers


# ---------------------------------------------------------------------------
# Processes, read from /proc
# ---------------------------------------------------------------------------


def _stat(pid: int):
    """(parent pid, state, start time) of a process, None when it is gone."""
    try:
        text = open(f"/proc/{pid}/stat").read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19])


def process_tree(root: int) -> dict[int, int]:
    """{pid: start time} of ``root`` and every descendant alive now."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)] = st
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in parents:
            tree[pid] = parents[pid][2]
            frontier += [child for child, (ppid, _, _) in parents.items() if ppid == pid]
    return tree


def still_running(tree: dict[int, int]) -> list[int]:
    """The processes of ``tree`` that still exist (same pid and start time), zombies not counted."""
    alive = []
    for pid, start in tree.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            alive.append(pid)
    return alive


def wait_until_gone(tree: dict[int, int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := still_running(tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def start_wrapper(args: list[str], env=None) -> subprocess.Popen:
    """`python -m dflash_lab.vllm_engine --quiet ARGS`; its output lines collect in ``.lines`` as they come."""
    process = subprocess.Popen([sys.executable, "-m", "dflash_lab.vllm_engine", "--quiet", *args], cwd=REPO_ROOT,
                               env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    process.lines = []
    threading.Thread(target=lambda: process.lines.extend(ln.rstrip("\n") for ln in process.stdout), daemon=True).start()
    return process


def read_until(process: subprocess.Popen, marker: str, timeout_s: float) -> list[str]:
    """The wrapper's output lines up to the one holding ``marker``; fails if it exits or times out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(marker in line for line in process.lines):
            return list(process.lines)
        if process.poll() is not None:
            time.sleep(0.5)  # the reader takes the last lines
            break
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"no {marker!r} from the wrapper (exit {process.poll()}):\n" + "\n".join(process.lines))


# ---------------------------------------------------------------------------
# A stand-in for vLLM's server: answers /health, has a child and a grandchild
# ---------------------------------------------------------------------------


STAND_IN = textwrap.dedent("""
    import http.server, socketserver, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    subprocess.Popen([sys.executable, "-c", f"import subprocess, time; subprocess.Popen({sleeper!r}); time.sleep(600)"])

    class Health(http.server.BaseHTTPRequestHandler):
        timeout = 5  # a connection that never sends its request is dropped, not waited on forever

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        # a thread per connection: one stalled probe cannot hold the ones queued behind it; and no
        # socket.getfqdn() in the bind (HTTPServer's own asks the resolver, which may hang on a machine offline)
        daemon_threads = True
        server_bind = socketserver.TCPServer.server_bind

    Server(("127.0.0.1", port), Health).serve_forever()
""")


@pytest.fixture
def stand_in_venv(tmp_path):
    """A "vLLM virtualenv" whose python runs the stand-in server, whatever module it is asked for."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'stand_in.py'} \"$@\"\n")
    python.chmod(0o755)
    return venv


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_each_stop_signal_stops_the_whole_tree(stand_in_venv, sig):
    # --method ngram: no drafter, so the wrapper skips asking vLLM 0.33's KV-cache grouping (~13 s of CPU)
    wrapper = start_wrapper(["--port", str(free_port()), "--method", "ngram"],
                            env={**os.environ, VLLM_VENV_ENV: str(stand_in_venv)})
    read_until(wrapper, READY, timeout_s=120)
    tree = process_tree(wrapper.pid)
    assert len(tree) >= 4, tree  # the wrapper, the server, its child and grandchild
    wrapper.send_signal(sig)
    assert wrapper.wait(timeout=60) == 0  # a stop asked for is a clean exit (no `make: *** Error 143`)
    assert wait_until_gone(tree, 30) == []


# ---------------------------------------------------------------------------
# vLLM itself: the README's request returns text; SIGTERM leaves no process
# ---------------------------------------------------------------------------


def readme_example_request() -> dict:
    """The JSON body of the README's example completion request (the `curl ... /v1/completions -d '...'` line)."""
    match = re.search(r"curl -s http://127\.0\.0\.1:PORT/v1/completions .*?-d '(\{.*?\})'",
                      (REPO_ROOT / "README.md").read_text())
    assert match, "the README has no example completion request"
    return json.loads(match.group(1))


@needs_vllm
@pytest.mark.slow
def test_sigterm_to_the_wrapper_stops_vllms_whole_tree_and_the_readme_request_returns_text():
    port = free_port()
    wrapper = start_wrapper(["--port", str(port)])
    tree = {}
    try:
        lines = read_until(wrapper, READY, timeout_s=600)
        assert f"http://127.0.0.1:{port}" in lines[0]  # the port comes first, before vLLM's minute of start-up
        tree = process_tree(wrapper.pid)
        assert len(tree) >= 3, tree  # the wrapper, vLLM's API server, its engine core
        body = readme_example_request()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        assert choice["text"].strip() and choice["finish_reason"] == "length", choice
    finally:
        tree = tree or process_tree(wrapper.pid)
        wrapper.send_signal(signal.SIGTERM)
        code = wrapper.wait(timeout=90)
        left = wait_until_gone(tree, 30)
    assert code == 0
    assert left == []


# ---------------------------------------------------------------------------
# Bad input: a clear message, no stray process, nothing written
# ---------------------------------------------------------------------------


@pytest.fixture
def started(monkeypatch):
    """Every process `serve` starts, to check that none is left running."""
    processes = []

    class Recording(server_module.EngineProcess):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            processes.append(self)

    monkeypatch.setattr(server_module, "EngineProcess", Recording)
    return processes


def file_tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size if p.is_file() else -1) for p in path.rglob("*"))


@needs_vllm
@pytest.mark.slow
def test_a_drafter_vllm_rejects_is_named_and_nothing_is_left(tmp_path, monkeypatch, started):
    bad = tmp_path / "drafter"
    bad.mkdir()
    config = json.loads((drafter_path() / "config.json").read_text())
    config["sliding_window"] = None  # transformers' LagunaConfig (strict) refuses null: vLLM cannot read it
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(drafter_path() / "model.safetensors")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = file_tree(tmp_path)
    with pytest.raises(VLLMEngineError, match="exited.*before it was ready") as failure:
        with serve(drafter=bad, progress=False, timeout_s=300):
            pass
    assert "sliding_window" in str(failure.value)
    assert len(started) == 1 and started[0].poll() is not None and not started[0].group_alive()
    assert file_tree(tmp_path) == before


@needs_vllm
def test_a_port_in_use_is_named_before_anything_starts(started):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(VLLMEngineError, match=f"port {port} on 127.0.0.1 is already in use"):
            with serve(port=port, progress=False):
                pass
    assert started == []


def test_a_missing_checkpoint_is_named(tmp_path, monkeypatch, started):
    missing = tmp_path / "no-such-drafter"
    monkeypatch.setenv(DRAFTER_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=rf"drafter checkpoint directory {missing} \(from \${DRAFTER_ENV}\)"):
        with serve(progress=False):
            pass
    with pytest.raises(FileNotFoundError, match="target checkpoint directory"):
        run_offline([[1, 2, 3]], EngineRun("x"), target=tmp_path / "no-such-target", progress=False)
    assert started == [] and not missing.exists()


def test_a_missing_vllm_venv_says_make_setup(tmp_path, started):
    with pytest.raises(VLLMEngineError, match="run `make setup`"):
        with serve(venv=tmp_path / "no-venv", progress=False):
            pass
    with pytest.raises(VLLMEngineError, match="run `make setup`"):
        run_offline([[1, 2, 3]], EngineRun("x"), venv=tmp_path / "no-venv", progress=False)
    assert started == [] and list(tmp_path.iterdir()) == []


def test_engine_env_turns_the_shim_on_and_off(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert "VLLM_PLUGINS" not in engine_env(shim=True)  # unset: vLLM loads every plugin
    assert engine_env(shim=False)["VLLM_PLUGINS"] == ""  # an allow-list naming none
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert engine_env(shim=True)["VLLM_PLUGINS"] == "other,dflash_lab_cpu_shim"
    assert engine_env(shim=False)["VLLM_PLUGINS"] == "other"
    assert os.environ["VLLM_PLUGINS"] == "other"  # the lab's own environment is not changed


# ---------------------------------------------------------------------------
# make serve PORT=..., make lab as root and not
# ---------------------------------------------------------------------------


def make_dry_run(target: str, *args: str, uid: int | None = None, tmp_path=None) -> list[str]:
    """The commands `make -n TARGET` would run; ``uid`` fakes what `id -u` prints."""
    env = dict(os.environ)
    if uid is not None:
        fake = tmp_path / "bin"
        fake.mkdir(exist_ok=True)
        (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
        (fake / "id").chmod(0o755)
        env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    done = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), target, *args], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_make_serve_passes_the_port():
    (line,) = [ln for ln in make_dry_run("serve", "PORT=8123") if "dflash_lab.vllm_engine" in ln]
    assert line.split("dflash_lab.vllm_engine", 1)[1].split() == ["--port", "8123"]
    (line,) = [ln for ln in make_dry_run("serve") if "dflash_lab.vllm_engine" in ln]
    assert "--port" not in line  # a free port, printed by the wrapper


@pytest.mark.parametrize("uid", [0, 1000], ids=["root", "user"])
def test_make_lab_allows_root_only_for_root(tmp_path, uid):
    (line,) = [ln for ln in make_dry_run("lab", uid=uid, tmp_path=tmp_path) if "jupyter lab" in ln]
    assert ("--allow-root" in line.split()) == (uid == 0), line


def test_the_wrapper_prints_the_readmes_example_request():
    from dflash_lab.vllm_engine.__main__ import example_request

    printed = example_request("http://127.0.0.1:PORT", "laguna-tiny-code")
    assert printed in (REPO_ROOT / "README.md").read_text()
    assert json.loads(printed.split("-d '", 1)[1].rstrip("'")) == readme_example_request()
