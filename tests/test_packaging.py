"""The two ways to install (pip via pyproject, conda via environment.yml) and the two commands stay in step."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def normalise(name: str) -> str:
    """PEP 503: case-insensitive, runs of -, _ and . are one separator."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {normalise(r.name): r for r in map(Requirement, deps)}


def environment_yml() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def conda_pip_requirements() -> dict[str, Requirement]:
    pip = [d["pip"] for d in environment_yml()["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip) == 1, "environment.yml should have exactly one pip: section"
    lines = [line for line in pip[0] if not line.startswith("-")]  # `-e .` installs the lab itself
    return {normalise(r.name): r for r in map(Requirement, lines)}


def test_environment_yml_and_pyproject_name_the_same_packages():
    pip, conda = set(pyproject_requirements()), set(conda_pip_requirements())
    assert pip == conda, f"only in pyproject: {sorted(pip - conda)}; only in environment.yml: {sorted(conda - pip)}"


def test_environment_yml_and_pyproject_pin_the_same_versions():
    pip, conda = pyproject_requirements(), conda_pip_requirements()
    differ = {n: (str(pip[n].specifier), str(conda[n].specifier)) for n in pip.keys() & conda.keys()
              if pip[n].specifier != conda[n].specifier}
    assert not differ, f"version constraints differ (pyproject, environment.yml): {differ}"


def test_the_pins_the_lab_depends_on():
    reqs = pyproject_requirements()
    assert reqs["vllm"].specifier.contains("0.33.0") and not reqs["vllm"].specifier.contains("0.34.0")
    # Laguna is in transformers from 5.17; vLLM 0.33 needs < 5.21.
    assert reqs["transformers"].specifier.contains("5.17.0") and not reqs["transformers"].specifier.contains("5.21.0")
    assert not reqs["transformers"].specifier.contains("5.16.0")


def test_environment_yml_installs_python_311_and_the_lab():
    deps = environment_yml()["dependencies"]
    assert "python=3.11" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert "-e ." in pip


def test_ci_runs_make_test():
    run = ROOT / ".ci" / "run"
    assert os.access(run, os.X_OK), ".ci/run must be executable"
    commands = [line.strip() for line in run.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in commands


def test_readme_leads_with_make_report_and_make_test():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```[a-z]*\n(.*?)```", text, re.S)
    assert first_block, "README has no command block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.split("#")[0].strip()]
    assert commands == ["make report", "make test"]
    # ... and they come before anything else the README asks you to run.
    assert text.index("make report") < text.index("make test") < min(
        (text.index(c) for c in ("make lab", "make setup", "conda env", "pip install") if c in text), default=len(text))


def test_make_report_and_make_test_set_up_first():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("report", "test"):
        rule = re.search(rf"^{target}:(.*)$", makefile, re.M)
        assert rule and "setup" in rule.group(1).split(), f"`make {target}` must depend on setup"
