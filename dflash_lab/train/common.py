"""What every training stage shares: the frozen target's helpers, schedules, clocks, logs.

Device, seeding and safe writes are not here: they are ``dflash_lab.runtime``'s.
"""

from __future__ import annotations

import math
import platform
import time

import torch
import transformers
from tqdm.auto import tqdm

from ..runtime import device_name, write_json

LOG_NAME = "training_log.json"  # written next to every checkpoint a stage makes


# ---------------------------------------------------------------------------
# The frozen target
# ---------------------------------------------------------------------------


def freeze(model):
    """No gradients, eval mode: the target (and a drafter under evaluation) only runs forwards."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def greedy_generate(target, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts ids (B, P) by n tokens, with a KV cache."""
    out = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(n - 1):
        out = target(input_ids=tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([ids, torch.stack(tokens, 1)], dim=1)  # (B, P + n)


def ensure_experts_implementation(model, example: torch.Tensor, *, backward: bool) -> str:
    """Use transformers' grouped-GEMM MoE where this torch supports it, else the per-expert loop."""
    try:
        on_gpu = example.device.type == "cuda"
        with torch.autocast(example.device.type, dtype=torch.bfloat16, enabled=backward and on_gpu):
            out = model(input_ids=example)
        if backward:
            out.logits.float().mean().backward()
            model.zero_grad(set_to_none=True)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        print(f"grouped-GEMM experts unavailable here ({type(e).__name__}: {str(e)[:120]}); using the eager loop")
        model.set_experts_implementation("eager")
    return model.config._experts_implementation


# ---------------------------------------------------------------------------
# Schedules and time budgets
# ---------------------------------------------------------------------------


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


class Clock:
    """Wall time since start, and how much of a time budget is left."""

    def __init__(self, budget_s: float | None = None):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - self.elapsed()


PACE_FROM, PACE_TO = 10, 30  # steps between which the pace is measured (after warm-up effects)
REFIT_EVERY = 100  # drafter training re-fits its step count to the time left this often


def fit_steps(planned: int, done: int, seconds_per_step: float, seconds_left: float) -> int:
    """How many steps fit: the planned number, or fewer if the time budget says so."""
    if not math.isfinite(seconds_left):
        return planned
    return max(done + 1, min(planned, done + int(seconds_left / max(seconds_per_step, 1e-6))))


def progress(total: int, desc: str, *, disable: bool = False, mininterval: float = 5.0):
    return tqdm(total=total, desc=desc, mininterval=mininterval, dynamic_ncols=True, disable=disable)


# ---------------------------------------------------------------------------
# Training logs
# ---------------------------------------------------------------------------


def run_info(device: torch.device) -> dict:
    """Where a stage ran, for its training log: device, hardware name, library versions."""
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "transformers": transformers.__version__, "device_name": device_name(device)}
    if device.type != "cuda":
        info["threads"] = torch.get_num_threads()
    return info


def write_log(path, log: dict) -> None:
    """A training log, atomically (indent 1, as the shipped logs are written)."""
    write_json(path, log, indent=1)
