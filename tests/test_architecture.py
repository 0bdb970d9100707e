"""The package's shape: a module per step, each small, no import cycles, plumbing at the bottom."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dflash_lab

PACKAGE = Path(dflash_lab.__file__).parent
MAX_LINES = 420  # "no module over ~400 lines"


def modules() -> dict[str, Path]:
    """'dflash_lab.spec_decode.loop' -> its file, for every module of the package."""
    found = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = file
    return found


def top_level_imports(name: str, file: Path, *, lazy: bool = False) -> set[str]:
    """Lab modules imported at module level (imports inside functions are lazy on purpose);
    ``lazy=True``: those inside functions too."""
    tree = ast.parse(file.read_text())
    package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in (ast.walk(tree) if lazy else tree.body):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("dflash_lab"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("dflash_lab"))
    return out


def import_graph(*, lazy: bool = False) -> dict[str, set[str]]:
    mods = modules()
    return {name: {t for t in top_level_imports(name, file, lazy=lazy) if t in mods and t != name}
            for name, file in mods.items()}


def module_map() -> list[str]:
    """The modules of dflash_lab/__init__.py's map, in its order: the layer order."""
    return [line.split()[0] for line in dflash_lab.__doc__.splitlines() if line.startswith("    ") and line.split()]


def test_no_module_is_over_about_400_lines():
    long = {name: n for name, file in modules().items() if (n := len(file.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_there_are_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):
                continue  # a package importing its own submodules is how packages work
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [nxt]))
            if state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_runtime_sits_at_the_bottom_of_the_import_graph():
    assert import_graph()["dflash_lab.runtime"] == set()
    text = (PACKAGE / "runtime.py").read_text()
    assert "from ." not in text and "import dflash_lab" not in text


def test_the_package_docstring_lists_every_module():
    doc = dflash_lab.__doc__
    listed = {line.split()[0] for line in doc.splitlines() if line.startswith("    ") and line.split()}
    top = {name.split(".")[1] for name in modules() if name.count(".") >= 1}
    assert top - listed == set(), f"modules missing from dflash_lab/__init__.py: {sorted(top - listed)}"
    assert listed - top == set(), f"listed but not in the package: {sorted(listed - top)}"


def _package_files_mentioning(text: str) -> set[str]:
    return {name for name, file in modules().items() if text in file.read_text()}


def test_attention_and_the_accept_rule_are_each_written_once():
    """One algorithm: every backend attends through layers.gqa_attention and accepts through sampling."""
    assert _package_files_mentioning("scaled_dot_product_attention(") == {"dflash_lab.layers"}
    assert _package_files_mentioning("def visible_keys(") == {"dflash_lab.block_attention"}


def _functions(module: str) -> dict[str, ast.FunctionDef]:
    """Every function and method of a package module, by name (methods as Class.name)."""
    tree = ast.parse(modules()[module].read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    return found


def _called(node: ast.AST) -> set[str]:
    """Names of what a piece of code calls: f(...) and obj.f(...) both give 'f'."""
    calls = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            calls.add(sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", ""))
    return calls


def test_the_prefix_count_is_written_once_and_every_rule_calls_it():
    """Prefix acceptance is one function, ``sampling.accepted_prefix_length``; no other code takes a cumprod."""
    where = {(name, fn) for name in modules() for fn, node in _functions(name).items() if "cumprod" in _called(node)}
    assert where == {("dflash_lab.spec_decode.sampling", "accepted_prefix_length")}
    top_level = {name for name, file in modules().items()
                 if any("cumprod" in _called(n) for n in ast.parse(file.read_text()).body
                        if not isinstance(n, (ast.FunctionDef, ast.ClassDef)))}
    assert not top_level
    sampling = _functions("dflash_lab.spec_decode.sampling")
    acceptance = _functions("dflash_lab.spec_decode.acceptance")
    for rule in ("greedy_accept_batch", "rejection_sample", "block_verify", "fly_accept", "synthetic_accept"):
        assert "accepted_prefix_length" in _called(sampling[rule]), rule
    assert "greedy_accept_batch" in _called(sampling["greedy_accept"])
    assert "accepted_prefix_length" in _called(acceptance["leading_runs"])
    for view in ("leading_run", "teacher_forced_acceptance_length", "stats_from_teacher_forcing"):
        assert "leading_runs" in _called(acceptance[view]), view


def test_the_residual_is_written_once():
    """(p - q)+ is taken in ``sampling.residual`` alone; every sampling rule resamples through ``_next_token``."""
    sampling = _functions("dflash_lab.spec_decode.sampling")
    clamps = {fn for fn, node in sampling.items() for sub in ast.walk(node)
              if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "clamp_min"
              and sub.args and isinstance(sub.args[0], ast.Constant) and sub.args[0].value == 0}
    assert clamps == {"residual"}
    assert "residual" in _called(sampling["residual_distribution"]) and "residual" in _called(sampling["block_verify"])
    assert "residual_distribution" in _called(sampling["_next_token"])
    for rule in ("rejection_sample", "block_verify", "fly_accept", "synthetic_accept"):
        assert "_next_token" in _called(sampling[rule]), rule


def test_counts_rates_and_tau_are_defined_once_in_spec_decode_stats():
    """The conditional rate has one definition (stats.conditional_acceptance_rates); the metric views delegate."""
    stats, sampling = _functions("dflash_lab.spec_decode.stats"), _functions("dflash_lab.spec_decode.sampling")
    assert "conditional_acceptance_rates" in _called(stats["SpecDecodeStats.conditional_acceptance_rate"])
    assert "conditional_acceptance_rates" in _called(sampling["unconditional_to_conditional_rates"])
    acceptance = _functions("dflash_lab.spec_decode.acceptance")
    views = ("tau", "accepted_per_draft", "unconditional_rates", "conditional_rates", "acceptance_length_histogram")
    for view in views:
        divides = [n for n in ast.walk(acceptance[view]) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
        assert not divides, f"acceptance.{view} recomputes what SpecDecodeStats defines"


def test_the_kv_cache_modules_and_the_fast_backend_are_sub_packages():
    names = set(modules())
    assert not {n for n in names if n.startswith("dflash_lab.kv_")} - {n for n in names if n.startswith("dflash_lab.kv_cache")}
    assert {"dflash_lab.spec_decode.fast.static_target", "dflash_lab.spec_decode.fast.static_drafter",
            "dflash_lab.spec_decode.fast.triton_ops", "dflash_lab.spec_decode.fast.cuda_graphs",
            "dflash_lab.spec_decode.fast.decoder"} <= names
    assert "dflash_lab.spec_decode.metrics" in names and "dflash_lab.metrics" not in names


def _unit(module: str) -> str:
    """The entry of the module map a module belongs to ('dflash_lab.kv_cache.groups' -> 'kv_cache')."""
    return module.split(".")[1]


def test_no_import_runs_up_the_module_map():
    """Each module imports (at module level) only what the map lists above its own entry."""
    rank = {unit: i for i, unit in enumerate(module_map())}
    up = sorted(f"{name} -> {dep}" for name, deps in import_graph().items() if name != "dflash_lab"
                for dep in deps if dep != "dflash_lab" and rank[_unit(dep)] > rank[_unit(name)])
    assert not up, "imports running up the order of dflash_lab/__init__.py: " + "; ".join(up)


def test_the_fused_context_kv_kernel_sits_below_the_drafter_and_the_backends_above_it():
    """context_kv's fused epilogue lives beside it: nothing at or below the drafter imports spec_decode, even
    inside a function, and only spec_decode itself, measure (it times the fast backend) and tools import
    spec_decode.fast."""
    graph = import_graph(lazy=True)
    assert graph["dflash_lab.context_kv"] >= {"dflash_lab.context_kv_kernel"}
    below = {f"dflash_lab.{unit}" for unit in ("layers", "context_kv_kernel", "context_kv", "drafter")}
    assert {name: {d for d in graph[name] if d.startswith("dflash_lab.spec_decode")} for name in below} == {
        name: set() for name in below}
    importers = {_unit(name) for name, deps in graph.items() if name != "dflash_lab"
                 and any(d.startswith("dflash_lab.spec_decode.fast") for d in deps)}
    assert importers <= {"spec_decode", "measure", "tools"}, importers


def test_kv_cache_engine_and_groups_do_not_import_each_other_both_ways():
    """groups asks the engine for rules="vllm-0.33"; the engine takes vLLM's grouping from grouping, not groups."""
    graph = import_graph(lazy=True)
    engine, groups = "dflash_lab.kv_cache.engine", "dflash_lab.kv_cache.groups"
    assert engine in graph[groups] and groups not in graph[engine]
    assert "dflash_lab.kv_cache.grouping" in graph[engine]
    import dflash_lab.kv_cache as kv_cache

    order = [line.split()[0] for line in kv_cache.__doc__.splitlines() if line.startswith("    ") and line.split()
             and f"dflash_lab.kv_cache.{line.split()[0]}" in graph]
    assert set(order) == {name.rsplit(".", 1)[1] for name in graph if name.startswith("dflash_lab.kv_cache.")}
    for i, name in enumerate(order):
        later = {f"dflash_lab.kv_cache.{m}" for m in order[i + 1:]}
        assert not graph[f"dflash_lab.kv_cache.{name}"] & later, f"kv_cache.{name} imports a module listed below it"


def test_importing_the_vllm_engine_loads_only_the_counters_of_spec_decode():
    """spec_decode exports its names lazily so that the counters load alone: ``make serve`` imports
    dflash_lab.vllm_engine, which needs SpecDecodeStats and the /metrics reader, not the drafter, transformers or
    Triton (importing the loop costs ~8 s on a 2-core CPU)."""
    code = ("import sys, dflash_lab.vllm_engine; "
            "print(sorted(m for m in ('transformers', 'triton', 'dflash_lab.drafter', 'dflash_lab.spec_decode.loop') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


MAX_LINE = 120


def test_no_line_is_over_120_characters():
    long = {f"{name}:{i}": len(line) for name, file in modules().items()
            for i, line in enumerate(file.read_text().splitlines(), 1) if len(line) > MAX_LINE}
    assert not long, f"lines over {MAX_LINE} characters: {long}"


def test_chapters_import_nothing_from_tools():
    """tools/ holds command lines; what a chapter runs lives in the package (measure/ for timings)."""
    sources = sorted((PACKAGE.parent / "notebooks" / "src").glob("*.py"))
    assert sources
    def imports_tools(file):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_lab"):
                if node.module.startswith("dflash_lab.tools") or any(a.name == "tools" for a in node.names):
                    return True
            if isinstance(node, ast.Import) and any(a.name.startswith("dflash_lab.tools") for a in node.names):
                return True
        return False

    offenders = [f.name for f in sources if imports_tools(f)]
    assert not offenders, f"chapters importing dflash_lab.tools: {offenders}"


# ---------------------------------------------------------------------------
# One proposer interface, checked by behaviour: every backend takes the same drafter
# argument through ``proposers.resolve_drafter``, refuses what it does not know, and
# drafts with what it is given (test_one_algorithm.py: the DFlash matrix).
# ---------------------------------------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def lab_pair():
    from dflash_lab.assets import heldout_prompts, load_default_pair

    target, drafter, tok = load_default_pair("cpu", dtype=torch.float32)
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-n:]) for p, n in zip(heldout_prompts(), (40, 23))]
    return target, drafter, prompts


def backends(target, prompts):
    """Every decoding backend, as a function of the drafter argument."""
    from dflash_lab.spec_decode import fast_generate, fast_generate_batch, speculative_generate
    from dflash_lab.spec_decode.fast.decoder import FastDecoder
    from dflash_lab.train import AcceptanceProbe
    from dflash_lab.train.evaluate import evaluate_acceptance

    return {
        "eager": lambda d: speculative_generate(target, d, prompts[0], max_new_tokens=4, block_size=4),
        "fast": lambda d: fast_generate(target, d, prompts[0], max_new_tokens=4, block_size=4, cuda_graphs=False),
        "fast batched": lambda d: fast_generate_batch(target, d, prompts, max_new_tokens=4, block_size=4,
                                                      cuda_graphs=False),
        "FastDecoder": lambda d: FastDecoder(target, d, batch=1, block_size=4, capacity=64, cuda_graphs=False),
        "evaluation": lambda d: AcceptanceProbe(target, [prompts[0]], max_new_tokens=4)(d, 4),
        "evaluate_acceptance": lambda d: evaluate_acceptance(target, d, None, [{"input_ids": prompts[0].tolist()}],
                                                             block_sizes=(4,), max_new_tokens=4),
    }


@pytest.mark.parametrize("unknown, error", [("eagle", ValueError), (object(), TypeError), (42, TypeError)],
                         ids=["a-method-name", "an-object", "a-number"])
def test_every_backend_refuses_an_unknown_drafter_by_name(lab_pair, unknown, error):
    target, _, prompts = lab_pair
    for name, run in backends(target, prompts).items():
        with pytest.raises(error, match="drafter must be a DFlashLagunaDrafter") as caught:
            run(unknown)
        assert "drafter" in str(caught.value), name


def test_every_backend_drafts_with_the_proposer_it_is_given(lab_pair):
    """Prompt lookup, "no drafter" and a proposer of the caller's own: the eager loop and the fast path
    (batch 1 and batched) give the same tokens and counts; a proposer is used, never replaced."""
    from dflash_lab.spec_decode import fast_generate_batch, speculative_generate
    from dflash_lab.spec_decode.proposers import PromptLookupDrafter

    class Repeat:  # a proposer the lab does not ship: propose the last token again
        block_size, max_block_size = 4, None

        def propose(self, tokens, num_draft):
            return [tokens[-1]] * num_draft

    target, _, prompts = lab_pair
    for drafter in ("ngram", None, PromptLookupDrafter(prompt_lookup_min=3, prompt_lookup_max=3), Repeat()):
        eager = [speculative_generate(target, drafter, p, max_new_tokens=12, block_size=4) for p in prompts]
        fast = fast_generate_batch(target, drafter, prompts, max_new_tokens=12, block_size=4, cuda_graphs=False)
        for e, f in zip(eager, fast):
            assert f.new_token_ids == e.new_token_ids, drafter
            got, want = f.stats, e.stats
            assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens) == (
                want.num_drafts, want.num_draft_tokens, want.num_accepted_tokens), drafter
            if want.num_drafts:  # (with no drafter the fast path runs block 1: no positions to count)
                assert got.num_accepted_tokens_per_pos == want.num_accepted_tokens_per_pos, drafter
    assert sum(r.stats.num_drafts for r in eager) > 0  # the home-made proposer did draft
