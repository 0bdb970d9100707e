"""vLLM's offline engine on token-id prompts, from the lab: outputs plus ``SpecDecodeStats``.

    results = run_offline(prompts, [EngineRun("dflash15", num_speculative_tokens=15),
                                    EngineRun("ngram7", method="ngram", num_speculative_tokens=7)],
                          max_new_tokens=64)
    results["dflash15"].outputs   # generated token ids per prompt
    results["dflash15"].stats     # SpecDecodeStats, read from vLLM's Prometheus counters

The lab writes a job file, runs ``offline_runner.py`` with ``.venv-vllm``'s
Python (vLLM's CPU build) and reads the result back; both files live in a
temporary directory that is removed afterwards. All runs of one call share one
runner process (vLLM is imported once); each run starts its own engine, since
the speculative config is fixed per engine.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..spec_decode.metrics import MetricsError, stats_from_prometheus_text
from ..runtime import is_int
from ..spec_decode import SpecDecodeStats
from .kv_grouping import needs_hybrid_manager_disabled
from .process import EngineProcess, VLLMEngineError, checkpoint_dirs, engine_env, vllm_python
from .server import KV_CACHE_MEMORY_BYTES

RUNNER = Path(__file__).with_name("offline_runner.py")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM's SpeculativeConfig.draft_sample_method


@dataclass
class EngineRun:
    """One engine configuration to run every prompt through."""

    name: str
    method: str | None = "dflash"  # "dflash", "ngram" (prompt lookup) or None (no speculation)
    num_speculative_tokens: int = 15
    temperature: float = 0.0
    draft_sample_method: str = "greedy"  # vLLM's default: drafts are the drafter's argmax
    prompt_lookup_min: int = 2  # ngram only; the lab's PromptLookupDrafter defaults
    prompt_lookup_max: int = 5
    prompts: list | None = field(default=None, repr=False)  # this run's own prompts (default: run_offline's)
    max_new_tokens: int | None = None  # this run's own length (default: run_offline's)
    drafter: object = None  # this run's drafter checkpoint directory (default: run_offline's)

    def __post_init__(self):
        if self.method not in ("dflash", "ngram", None):
            raise ValueError(f"EngineRun {self.name!r}: method must be 'dflash', 'ngram' or None, got {self.method!r}")
        if self.drafter is not None and self.method != "dflash":
            raise ValueError(f"EngineRun {self.name!r}: a drafter is only used by method 'dflash', not {self.method!r}")
        n = self.num_speculative_tokens
        if not is_int(n) or n < 1:
            raise ValueError(f"EngineRun {self.name!r}: num_speculative_tokens must be an integer >= 1, got {n!r}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"EngineRun {self.name!r}: draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                             f"got {self.draft_sample_method!r}")
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise ValueError(f"EngineRun {self.name!r}: max_new_tokens must be None or an integer >= 1, "
                             f"got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"EngineRun {self.name!r}: temperature must be a number >= 0, got {self.temperature!r}")


@dataclass
class EngineResult:
    """What one run produced: generated token ids per prompt and vLLM's spec-decode counters."""

    name: str
    outputs: list[list[int]]
    stats: SpecDecodeStats
    metrics_text: str = field(repr=False)  # the spec-decode exposition after the run (Prometheus text)
    per_prompt: list[SpecDecodeStats] | None = field(default=None, repr=False)  # from vLLM's per-request metrics
    engine_start_s: float = 0.0
    generate_s: float = 0.0
    vllm_version: str = ""
    shim: dict | None = None  # fixes the CPU shim applied; None when it was not loaded
    hybrid_manager_disabled: bool = False  # served with --disable-hybrid-kv-cache-manager (kv_grouping.py)
    drafter: Path | None = None  # the drafter checkpoint this run's engine loaded (None: no drafter)


def _stats(before: str, after: str) -> SpecDecodeStats:
    """The run's counters: after - before (vLLM's counters are cumulative)."""
    if not after:
        return SpecDecodeStats()
    stats = stats_from_prometheus_text(after)
    try:
        return stats - stats_from_prometheus_text(before)
    except MetricsError:  # no counters before the first step
        return stats


def _per_prompt(steps, num_speculative_tokens: int) -> list[SpecDecodeStats] | None:
    """Per-prompt stats from vLLM's per-request [drafted, accepted] steps (None without speculation)."""
    if steps is None or any(s is None for s in steps):
        return None
    per_prompt = []
    for prompt_steps in steps:
        stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)
        for drafted, accepted in prompt_steps:
            if drafted:  # a step that proposed nothing is not a draft (vLLM's counters skip it too)
                stats.observe_draft(drafted, accepted)
        per_prompt.append(stats)
    return per_prompt


def _check_prompts(prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    checked = []
    for i, p in enumerate(prompts):
        ids = p.tolist() if hasattr(p, "tolist") else list(p)
        if not ids or not all(is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"prompts[{i}] must be a non-empty list of non-negative token ids")
        checked.append(ids)
    if not checked:
        raise ValueError("prompts is empty")
    return checked


def run_offline(prompts, runs, *, max_new_tokens: int = 64, seed: int = 0, target=None, drafter=None,
                dtype: str = "float32", max_model_len: int | None = None, enforce_eager: bool = True,
                shim: bool = True, in_process: bool = True, venv=None, timeout_s: float = 1200.0,
                progress: bool = True, echo=None, disable_hybrid_kv_cache_manager: bool | None = None,
                ) -> dict[str, EngineResult]:
    """Every prompt through vLLM's ``LLM`` once per run; {run name: EngineResult}.

    prompts: token-id lists (given to vLLM as ``TokensPrompt``: no tokenizer in
    between); a run may bring its own (``EngineRun.prompts``, ``.max_new_tokens``,
    ``.drafter``: one runner process serves several drafters, an engine each).
    Prompt i is sampled with seed + i. Generation ignores EOS and
    makes exactly ``max_new_tokens`` tokens, like ``speculative_generate`` with
    no stop tokens. in_process runs vLLM's engine in the runner's own process
    (saves two vLLM imports per run). shim=False runs without the CPU shim.
    disable_hybrid_kv_cache_manager: None decides by vLLM's grouping, run by run:
    on only where the drafter's layers would land in two KV-cache groups (kv_grouping.py).
    """
    runs = [runs] if isinstance(runs, EngineRun) else list(runs)
    if not runs or not all(isinstance(r, EngineRun) for r in runs):
        raise TypeError("runs must be one EngineRun or a non-empty list of them")
    if len({r.name for r in runs}) != len(runs):
        raise ValueError(f"run names must be unique, got {[r.name for r in runs]}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    prompts = _check_prompts(prompts) if prompts is not None else None
    run_prompts = {r.name: _check_prompts(r.prompts) if r.prompts is not None else prompts for r in runs}
    if any(p is None for p in run_prompts.values()):
        raise ValueError("prompts is None: give prompts, or prompts= to every EngineRun")
    run_tokens = {r.name: r.max_new_tokens or max_new_tokens for r in runs}
    target_dir, drafter_dir = checkpoint_dirs(
        target, drafter, need_drafter=any(r.method == "dflash" and r.drafter is None for r in runs))
    run_drafter = {r.name: (checkpoint_dirs(target_dir, r.drafter)[1] if r.drafter is not None else drafter_dir)
                   if r.method == "dflash" else None for r in runs}
    python = vllm_python(venv)
    hybrid_off = {name: bool(disable_hybrid_kv_cache_manager) if disable_hybrid_kv_cache_manager is not None
                  else d is not None and needs_hybrid_manager_disabled(target_dir, d)
                  for name, d in run_drafter.items()}
    longest = max(len(p) + run_tokens[r.name] + r.num_speculative_tokens + 1 for r in runs for p in run_prompts[r.name])
    job = {"target": str(target_dir),
           "dtype": dtype, "max_model_len": max_model_len or max(512, longest),
           "kv_cache_memory_bytes": KV_CACHE_MEMORY_BYTES, "enforce_eager": enforce_eager, "seed": seed,
           "runs": [{**asdict(r), "prompts": run_prompts[r.name], "max_new_tokens": run_tokens[r.name], "seed": seed,
                     "drafter": str(run_drafter[r.name]) if run_drafter[r.name] else None,
                     "disable_hybrid_kv_cache_manager": hybrid_off[r.name]} for r in runs]}

    with tempfile.TemporaryDirectory(prefix="dflash-lab-vllm-") as tmp, \
            tqdm(total=len(runs), desc="vLLM offline runs", unit="run", disable=not progress, leave=False) as bar:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))

        def on_line(line: str) -> None:
            if line.startswith("OFFLINE_RUNNER_DONE "):
                bar.update(1)
                bar.set_postfix_str(line.split(" ", 1)[1])

        process = EngineProcess([str(python), str(RUNNER), str(job_path), str(result_path)],
                                engine_env(shim=shim, in_process=in_process), cwd=tmp, echo=echo, on_line=on_line)
        try:
            start = time.monotonic()
            while process.poll() is None:
                if time.monotonic() - start > timeout_s:
                    raise VLLMEngineError(f"vLLM's offline runner did not finish within {timeout_s:.0f} s:\n"
                                          f"{process.failure_summary()}")
                time.sleep(0.2)
        finally:
            process.stop()
        if process.poll() != 0 or not result_path.is_file():
            raise VLLMEngineError(f"vLLM's offline runner failed (exit code {process.poll()}):\n"
                                  f"{process.failure_summary()}")
        result = json.loads(result_path.read_text())
    sizes = {run.name: run.num_speculative_tokens for run in runs}
    return {r["name"]: EngineResult(name=r["name"], outputs=r["outputs"],
                                    stats=_stats(r["metrics_before"], r["metrics_text"]),
                                    metrics_text=r["metrics_text"],
                                    per_prompt=_per_prompt(r["steps"], sizes[r["name"]]),
                                    engine_start_s=r["engine_start_s"], generate_s=r["generate_s"],
                                    vllm_version=result["vllm_version"], shim=result["shim"],
                                    hybrid_manager_disabled=hybrid_off[r["name"]], drafter=run_drafter[r["name"]])
            for r in result["runs"]}


def offline_generate(prompts, *, num_speculative_tokens: int = 15, method: str | None = "dflash",
                     temperature: float = 0.0, draft_sample_method: str = "greedy", **kwargs) -> EngineResult:
    """One run of ``run_offline``: (outputs, stats) of vLLM's engine on ``prompts``."""
    run = EngineRun("run", method=method, num_speculative_tokens=num_speculative_tokens, temperature=temperature,
                    draft_sample_method=draft_sample_method)
    return run_offline(prompts, [run], **kwargs)["run"]
