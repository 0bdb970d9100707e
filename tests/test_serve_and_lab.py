"""Serving as a user meets it: bad input to `serve` / `run_offline` gives clear errors, no stray process, nothing written."""

from __future__ import annotations

import json
import os
import socket

import pytest

from dflash_lab.runtime import DRAFTER_ENV, drafter_path
from dflash_lab.vllm_engine import EngineRun, VLLMEngineError, run_offline, serve
from dflash_lab.vllm_engine import server as server_module
from dflash_lab.vllm_engine.process import VLLM_VENV, engine_env

needs_vllm = pytest.mark.skipif(not (VLLM_VENV / ".installed").is_file(), reason="needs .venv-vllm: run `make setup`")


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
