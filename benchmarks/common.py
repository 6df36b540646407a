"""What every benchmark script here shares: the machine line, the versions line, the table, the output."""

from __future__ import annotations

from pathlib import Path

import torch


def markdown_table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from specgate.report.provenance import cpu_model

    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def versions() -> str:
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def emit(text: str, out: str | None) -> None:
    """Print the page, and write it to `out` when given."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
