"""What every benchmark script here shares: the machine line, the versions line, the table, the output."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# Model shapes a benchmark can build with random weights: --shape NAME, or LlamaConfig kwargs as JSON.
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True),
}  # fmt: skip


def shape_fields(shape: str) -> dict:
    """LlamaConfig kwargs for --shape: a name from SHAPES, or a JSON object."""
    return dict(SHAPES[shape]) if shape in SHAPES else json.loads(shape)


def shape_name(shape: str) -> str:
    """How the page names the shape: its name, or its JSON in one line."""
    return shape if shape in SHAPES else json.dumps(json.loads(shape))


def parser(doc: str) -> argparse.ArgumentParser:
    """The script's docstring: first paragraph as the description, the rest as the epilog."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=doc.split("\n\n", 1)[1] if "\n\n" in doc else None)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
