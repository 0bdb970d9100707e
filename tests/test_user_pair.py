"""A researcher's own pair, in the real format: every chapter runs on it, and its bad files are named.

The pair is built once per session by ``dflash_lab.user_pair`` (random weights): the target saved
by transformers' ``save_pretrained`` as several safetensors shards with an index, in Laguna-XS.2's
layer pattern, with its own tokenizer and a vocabulary unlike the shipped 4096; a drafter at the
Laguna-XS-2.1-DFlash preset's shape with shrunk widths. Each chapter is executed once (as ``make
report`` does) and several assertions read the one executed notebook.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dflash_lab import assets
from dflash_lab.config import ConfigError
from dflash_lab.pair_files import INDEX_NAME, PairFileError, check_pair_files, weight_files
from dflash_lab.runtime import DRAFTER_ENV, REPO_ROOT, TARGET_ENV
from dflash_lab.user_pair import build_user_pair

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("0*.ipynb"))


@pytest.fixture(scope="session")
def user_pair(tmp_path_factory):
    return build_user_pair(tmp_path_factory.mktemp("user-pair"))


@pytest.fixture
def use_pair(monkeypatch):
    """Point the lab at a pair the way a user does, with the environment variables."""
    def use(paths):
        monkeypatch.setenv(TARGET_ENV, str(paths["target"]))
        monkeypatch.setenv(DRAFTER_ENV, str(paths["drafter"]))
        monkeypatch.delenv(assets.DRAFTER2_ENV, raising=False)
    return use


@pytest.fixture
def broken_pair(user_pair, tmp_path):
    """A copy of the user pair to damage."""
    out = {k: tmp_path / k for k in ("target", "drafter")}
    for k, path in out.items():
        shutil.copytree(user_pair[k], path)
    return out


# ---------------------------------------------------------------------------
# The format
# ---------------------------------------------------------------------------


def test_the_built_pair_is_in_the_real_format(user_pair):
    target = user_pair["target"]
    index = json.loads((target / INDEX_NAME).read_text())["weight_map"]
    shards = weight_files(target)
    assert len(shards) >= 2 and {p.name for p in shards} == set(index.values())
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["vocab_size"] != 4096 and cfg["layer_types"][:4] == ["full_attention"] + ["sliding_attention"] * 3
    assert cfg["mlp_layer_types"][0] == "dense" and set(cfg["mlp_layer_types"][1:]) == {"sparse"}
    assert cfg["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    drafter = json.loads((user_pair["drafter"] / "config.json").read_text())
    assert drafter["layer_types"] == ["sliding_attention"] * 5 and drafter["dflash_config"]["causal"] is True
    assert drafter["draft_vocab_size"] == cfg["vocab_size"] and drafter["hidden_size"] == cfg["hidden_size"]
    check_pair_files(target, user_pair["drafter"])  # a good pair passes


def test_the_pair_loads_and_decodes_losslessly_in_float32(user_pair, use_pair):
    from dflash_lab.spec_decode import speculative_generate

    use_pair(user_pair)
    target, drafter, tokenizer = assets.load_default_pair(device="cpu")
    assert target.config.vocab_size == len(tokenizer) and drafter.config.num_hidden_layers == 5
    ids = torch.tensor([tokenizer("def add(a, b):\n    return")["input_ids"]])
    out = speculative_generate(target, drafter, ids, max_new_tokens=12, block_size=8)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.output_ids, plain)


def test_the_fingerprint_covers_every_shard_and_the_shipped_records_are_not_yours(user_pair, broken_pair, use_pair):
    use_pair(user_pair)
    mine = assets.pair_fingerprint()
    assert set(mine) == {"target", "paper"}  # no second drafter for another target
    assert not assets.is_shipped_pair() and assets.second_drafter_missing()
    shipped_record = json.loads((REPO_ROOT / "benchmarks" / "spec_decode.json").read_text())
    assert not assets.measured_on_this_pair(shipped_record)
    assert "shipped pair's committed run" in assets.record_note(shipped_record)
    assert assets.record_note({"pair": mine}) is None
    last = weight_files(broken_pair["target"])[-1]  # one byte of the last shard changes the target's digest
    data = bytearray(last.read_bytes())
    data[-1] ^= 1
    last.write_bytes(bytes(data))
    use_pair(broken_pair)
    assert assets.pair_fingerprint()["target"] != mine["target"]
    assert assets.pair_fingerprint()["paper"] == mine["paper"]


def test_a_second_drafter_comes_from_its_variable(user_pair, use_pair, monkeypatch):
    use_pair(user_pair)
    with pytest.raises(FileNotFoundError, match=assets.DRAFTER2_ENV):
        assets.load_default_pair(device="cpu", drafter="poolside")
    monkeypatch.setenv(assets.DRAFTER2_ENV, str(user_pair["drafter"]))
    assert assets.pair_drafters()["poolside"] == user_pair["drafter"]
    assert assets.second_drafter_missing() is None


def test_benchmarks_of_another_pair_never_write_into_the_committed_records(user_pair, use_pair, monkeypatch):
    from dflash_lab.tools.bench_common import pair_out_dir

    monkeypatch.delenv(TARGET_ENV, raising=False)
    monkeypatch.delenv(DRAFTER_ENV, raising=False)
    assert pair_out_dir() == REPO_ROOT / "benchmarks"
    use_pair(user_pair)
    assert pair_out_dir() == REPO_ROOT / "runs" / "benchmarks" / "target"
    assert pair_out_dir("/elsewhere") == Path("/elsewhere")


def _vllm_venv_ready() -> bool:
    from dflash_lab.vllm_engine.process import VLLM_VENV

    return (VLLM_VENV / ".installed").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not _vllm_venv_ready(), reason="needs .venv-vllm: run `make setup`")
def test_vllms_engine_decodes_the_users_pair_as_the_lab_does(user_pair, use_pair):
    """vLLM's own engine loads the sharded target (YaRN, per-layer heads, MoE) and the XS-2.1-shaped drafter, and
    gives the lab's tokens and counters, greedy in float32."""
    from dflash_lab.spec_decode import generate_on_prompts
    from dflash_lab.vllm_engine import EngineRun, run_offline

    use_pair(user_pair)
    target, drafter, tokenizer = assets.load_default_pair(device="cpu")
    prompts = [tokenizer(p["text"])["input_ids"][-48:] for p in assets.heldout_prompts()[:3]]
    run = run_offline(prompts, [EngineRun("user15", num_speculative_tokens=15)], max_new_tokens=24,
                      target=user_pair["target"], drafter=user_pair["drafter"], progress=False)["user15"]
    stats, results = generate_on_prompts(target, drafter, prompts, max_new_tokens=24, block_size=16, progress=False)
    assert run.outputs == [r.new_token_ids for r in results]
    assert (run.stats.num_drafts, run.stats.num_draft_tokens, run.stats.num_accepted_tokens,
            run.stats.num_accepted_tokens_per_pos) == (stats.num_drafts, stats.num_draft_tokens,
                                                       stats.num_accepted_tokens, stats.num_accepted_tokens_per_pos)
    assert run.stats.num_drafts > 0 and run.drafter == user_pair["drafter"].resolve()


# ---------------------------------------------------------------------------
# Bad files: one clear error naming the file (and key), before anything loads
# ---------------------------------------------------------------------------


def _shards(pair):
    return weight_files(pair["target"])


def test_a_missing_shard_is_named(broken_pair):
    gone = _shards(broken_pair)[1]
    gone.unlink()
    with pytest.raises(PairFileError, match=rf"{INDEX_NAME} names shard file\(s\) \['{gone.name}'\]"):
        check_pair_files(broken_pair["target"], broken_pair["drafter"])


def test_an_index_naming_a_missing_file_is_named(broken_pair):
    index_file = broken_pair["target"] / INDEX_NAME
    index = json.loads(index_file.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-99999-of-99999.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(PairFileError, match="model-99999-of-99999.safetensors"):
        check_pair_files(broken_pair["target"], broken_pair["drafter"])


def test_a_truncated_shard_is_named(broken_pair):
    shard = _shards(broken_pair)[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(PairFileError, match=rf"{shard.name} is not a readable safetensors file"):
        check_pair_files(broken_pair["target"], broken_pair["drafter"])


def test_a_tensor_the_index_misplaces_is_named(broken_pair):
    index_file = broken_pair["target"] / INDEX_NAME
    index = json.loads(index_file.read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    name = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][name] = second
    index_file.write_text(json.dumps(index))
    with pytest.raises(PairFileError, match=rf"places tensors in shards that do not hold them: {name} \(in {second}\)"):
        check_pair_files(broken_pair["target"], broken_pair["drafter"])


def test_shards_without_an_index_are_refused(broken_pair):
    (broken_pair["target"] / INDEX_NAME).unlink()
    with pytest.raises(PairFileError, match=f"but no {INDEX_NAME}"):
        check_pair_files(broken_pair["target"], broken_pair["drafter"])


@pytest.mark.parametrize("key, value, error, message", [
    ("draft_vocab_size", 4096, ConfigError, "`draft_vocab_size` 4096 != target vocab_size"),
    ("hidden_size", 96, ConfigError, "`hidden_size` 96 != target hidden_size 128"),
    ("dflash_config.target_layer_ids", [1, 2, 9], ConfigError, r"`dflash_config.target_layer_ids` \[9\] do not exist"),
    # mixed layer types: vLLM's DFlashLagunaModel raises NotImplementedError, and so does the lab
    ("layer_types", ["sliding_attention"] * 4 + ["full_attention"], NotImplementedError, "`layer_types` must be uniform"),
])
def test_a_drafter_that_does_not_fit_the_target_is_named(broken_pair, key, value, error, message):
    file = broken_pair["drafter"] / "config.json"
    cfg = json.loads(file.read_text())
    if key.startswith("dflash_config."):
        cfg["dflash_config"][key.split(".")[1]] = value
        cfg.pop("eagle_aux_hidden_state_layer_ids")
    else:
        cfg[key] = value
        if key == "draft_vocab_size":
            cfg["vocab_size"] = value
    file.write_text(json.dumps(cfg))
    with pytest.raises(error, match=message) as err:
        check_pair_files(broken_pair["target"], broken_pair["drafter"])
    assert str(file) in str(err.value)


def test_a_target_config_that_is_not_laguna_is_named(broken_pair):
    file = broken_pair["target"] / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "model_type": "llama"}))
    with pytest.raises(PairFileError, match=r"config.json: key `model_type` is 'llama'"):
        check_pair_files(broken_pair["target"], broken_pair["drafter"])


def test_loading_a_broken_pair_stops_before_any_weights_load(broken_pair, use_pair, monkeypatch):
    import dflash_lab.target as target_module

    _shards(broken_pair)[-1].unlink()
    use_pair(broken_pair)
    before = sorted(p.name for p in broken_pair["target"].iterdir())
    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(PairFileError, match="names shard file"):
        assets.load_default_pair(device="cpu")
    assert sorted(p.name for p in broken_pair["target"].iterdir()) == before  # nothing written


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    import dflash_lab.checkpoint as checkpoint

    def fail(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(checkpoint, "save_drafter", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        build_user_pair(tmp_path / "pair")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the pair nor a temporary folder


def test_the_builder_never_replaces_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a pair this builder wrote"):
        build_user_pair(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------
# Every chapter on the user's pair: executed once each, read by several assertions
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")  # its environment is put back before the next test file runs
def executed(user_pair, tmp_path_factory):
    """chapter name -> its notebook executed on the user pair (as `make report` runs it), or the error."""
    from dflash_lab.repro import write_ipython_startup
    from dflash_lab.tools.report import NotebookFailed, execute_notebook

    ipython_dir = tmp_path_factory.mktemp("ipython")
    write_ipython_startup(str(ipython_dir))  # the kernel, too, reaches loopback only
    env = {TARGET_ENV: str(user_pair["target"]), DRAFTER_ENV: str(user_pair["drafter"]), "IPYTHONDIR": str(ipython_dir),
           "DFLASH_LAB_DEVICE": "cpu"}
    saved = {k: os.environ.get(k) for k in [*env, assets.DRAFTER2_ENV]}
    os.environ.update(env)
    os.environ.pop(assets.DRAFTER2_ENV, None)
    cache = {}

    # Chapter 3 runs as on a GPU machine that has no vLLM: a `vllm` package that refuses to import comes first on
    # the kernel's path (the shipped pair's run, under nbval and in the browser, takes vLLM's own branch)
    no_vllm = tmp_path_factory.mktemp("no-vllm")
    (no_vllm / "vllm").mkdir()
    (no_vllm / "vllm" / "__init__.py").write_text(
        'raise ImportError("No module named \'vllm\' (hidden by the test)")\n')

    def run(path: Path):
        if path.stem not in cache:
            hide = path.stem.startswith("03")
            before = os.environ.get("PYTHONPATH")
            if hide:
                os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(no_vllm), before]))
            try:
                cache[path.stem] = execute_notebook(path, store_widget_state=False, record_timing=False)[0]
            except NotebookFailed as e:
                cache[path.stem] = e
            finally:
                if hide:
                    os.environ.pop("PYTHONPATH") if before is None else os.environ.__setitem__("PYTHONPATH", before)
        return cache[path.stem]
    yield run
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", "") if "text" in o else "\n".join(
                str(o.get("data", {}).get(m, "")) for m in ("text/plain", "text/markdown")))
    return "\n".join(out)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_chapter_runs_on_the_users_pair(executed, path, user_pair):
    nb = executed(path)
    assert not isinstance(nb, Exception), f"{path.name} failed on a user's pair:\n{nb}"
    text = _text(nb)
    assert "the shipped trained pair" not in text and "The shipped pair:" not in text
    chapter = path.stem[:2]
    if chapter == "02":
        assert f"your pair: {user_pair['target']}" in text
    if chapter in ("03", "09"):  # the second drafter belongs to the shipped target: skipped, and said so
        assert "skipped:" in text and assets.DRAFTER2_ENV in text
    if chapter == "03":  # run without vLLM: its grouping is said to be missing, and the chapter goes on to its end
        assert "vLLM is not importable here, so its KV-cache grouping of this pair is not shown" in text
        assert "drafter layers per KV-cache group" not in text and "live vLLM run skipped" in text
    if chapter == "04":
        assert "Your pair (`target` + `drafter`)" in text
    if chapter in ("05", "07", "08", "09"):  # committed records are labelled as the shipped pair's
        assert "the shipped pair's committed run, not your pair (target)" in text
    if chapter == "06":
        assert "is not checked on your pair" in text
    if chapter == "09":  # the pair is named, and its one drafter's live run stays lossless
        assert "your pair (target + drafter)" in text and "every run's tokens equal target-only's: ['4/4']" in text
