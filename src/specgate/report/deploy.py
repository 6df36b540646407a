"""The command that deploys the report's answer: the recommended gate on the sweep's own server flags."""

from __future__ import annotations

import json
from pathlib import Path


def served_paths(target: str, drafter: str) -> tuple[str, str]:
    """What a deployment serves: an in-place target from its own directory, a drafter taken from
    drafter.path from its own; what the workflow built from results/ (relative to the directory it ran
    in, so an archive's report, rebuilt elsewhere, prints the same line)."""
    manifest = json.loads((Path(target) / "manifest.json").read_text())
    target_path = manifest["path"] if manifest.get("in_place") else target
    origin = Path(drafter) / "origin.json"
    drafter_path = json.loads(origin.read_text())["path"] if origin.exists() else drafter
    return target_path, drafter_path


def deployed_variant(decision) -> str:
    """What to run: no speculation where it lost everywhere, else the pick (break-even: the pick, if it
    stays on)."""
    return "nospec" if decision.verdict == "no speculation" or decision.pick is None else decision.pick


def launch(config: dict, decision, target: str, drafter: str, work_dir: str, repo: str | None = None) -> dict:
    """{"variant", "env", "argv", "command", "install"} for the deployed variant."""
    from specgate.sweep.bench import serve_settings, variant_by_name
    from specgate.sweep.launcher import launch_line

    target_path, drafter_path = served_paths(target, drafter)
    name = deployed_variant(decision)
    variant = variant_by_name(name, config["bench"])
    settings = serve_settings(config["serve"], target_path, drafter_path if variant.speculative else None,
                              config["device"])  # fmt: skip
    line = launch_line(config["serve"]["engine"], settings, variant, work_dir)
    # the plugin is specgate itself; SGLang's environment already has what it imports
    line["install"] = f"pip install --no-deps {repo or '<the specgate checkout>'}"
    return line


def section(line: dict) -> list[str]:
    return ["", "## Deploy", "",
            f"`{line['variant']}` on the sweep's server flags (`specgate launch-line {'results/report/recommendation.json'}` "
            "prints the same):", "", "```sh", line["install"], line["command"], "```"]  # fmt: skip
