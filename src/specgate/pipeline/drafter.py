"""Take an existing EAGLE-3 drafter (`drafter.path`) instead of training one.

The drafter is checked against the target with the same contract the export checks
(`specgate.pipeline.export.check_draft`): architecture, hidden size, vocabulary, draft vocabulary
mapping (d2t / t2d), aux layers, and every tensor SGLang loads. It is then linked, not copied, into
`results/drafter`, so SGLang and acceptance read the operator's own files. With `target.widen`
it is also widened to the served target's shape, as a trained drafter would be.
"""

from __future__ import annotations

import logging
from pathlib import Path

from specgate.files import atomic_path, write_json
from specgate.pipeline.export import DraftContractError, check_draft, widen_drafter

log = logging.getLogger(__name__)
FILES = ("config.json", "model.safetensors")


def take_drafter(path: str, out_dir: str, target_dir: str, *, widened_target: str | None = None,
                 widened_out: str | None = None) -> dict:  # fmt: skip
    """Check `path` against the target in `target_dir`; link its files into `out_dir`."""
    src = Path(path).resolve()
    for name in FILES:
        if not (src / name).is_file():
            other = sorted(p.name for p in src.glob("*.bin")) if name == "model.safetensors" else []
            hint = f"; it has {other}: save it as safetensors" if other else ""
            raise DraftContractError(f"config key 'drafter.path': {src / name} is missing{hint}")
    try:
        check_draft(src, target_dir)
    except DraftContractError as e:
        raise DraftContractError(f"config key 'drafter.path': {e}") from None
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for name in FILES:
            (tmp / name).symlink_to(src / name)
        info = {"source": "drafter.path", "path": str(src)}
        write_json(tmp / "origin.json", info)
    log.info("drafter %s checked against %s and linked into %s", src, target_dir, out_dir)
    if widened_target:
        widen_drafter(out_dir, widened_out, widened_target)
    return info
