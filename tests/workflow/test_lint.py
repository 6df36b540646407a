"""The workflow passes Snakemake's own linter and snakefmt's formatting check."""

import subprocess
import sys

from conftest import REPO


def test_snakemake_lint_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--lint", "--cores", "1"],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Congratulations, your workflow is in a good condition" in proc.stdout + proc.stderr


def test_rule_files_are_snakefmt_formatted():
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "Snakefile", "workflow/rules"],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_every_rule_has_a_script_and_module_of_its_name():
    """Rule X runs workflow/scripts/X.py, which calls specgate's stage module X."""
    rules = sorted(p.stem for p in (REPO / "workflow/rules").glob("*.smk") if p.stem != "common")
    scripts = sorted(p.stem for p in (REPO / "workflow/scripts").glob("*.py"))
    assert rules == scripts
    for rule in rules:
        text = (REPO / f"workflow/rules/{rule}.smk").read_text()
        assert f"rule {rule}:" in text and f'"../scripts/{rule}.py"' in text, rule
        script = (REPO / f"workflow/scripts/{rule}.py").read_text()
        assert f".{rule} import" in script, f"workflow/scripts/{rule}.py does not call a module named {rule}"
