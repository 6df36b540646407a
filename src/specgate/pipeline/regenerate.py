"""Self-distillation: replace assistant turns with the target's own greedy (or sampled) responses.

A drafter learns to predict the target, so training on the target's own outputs
raises acceptance. Turns are regenerated in order, each conditioned on the already
regenerated history. Work is done in chunks, each written atomically, so a killed
run resumes at the first missing chunk.

Two engines write the replies (data.regenerate.engine): SGLang's offline engine, which
batches and caches prefixes on a GPU, and specgate's reference decoder, which runs on
any device. Both take the same token-id prompts and stop at the same ids, and their
replies are decoded by the same tokenizer call, so their records have one format.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from specgate.files import ShardDir, read_jsonl, sha256_file, stable_hash, write_json, write_jsonl
from specgate.model.chat import eos_ids, prompt_ids
from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder
from specgate.runtime import inheritable_stream, keep_freed_memory, pick_device, worker_main

log = logging.getLogger(__name__)


# -- which engine -------------------------------------------------------------------


def sglang_missing() -> str | None:
    """Why SGLang's engine cannot run here, or None."""
    try:
        spec = importlib.util.find_spec("sglang")
    except ValueError:  # an `sglang` in sys.modules without a spec
        spec = None
    if spec is None or spec.origin is None:  # a folder named sglang on sys.path is no SGLang
        return "SGLang is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def resolve_engine(engine: str) -> str:
    """The engine that writes the replies: `auto` is SGLang where it can run (installed, CUDA visible)."""
    if engine not in ("auto", "sglang", "reference"):
        raise ValueError(f"config key 'data.regenerate.engine': {engine!r} is not one of auto, sglang, reference")
    if engine == "reference":
        return engine
    missing = sglang_missing()
    if engine == "auto":
        return "reference" if missing else "sglang"
    if missing:
        raise ValueError(f"config key 'data.regenerate.engine': sglang needs SGLang and a CUDA device, but {missing}; "
                         "set it to auto or reference")  # fmt: skip
    return engine


# -- SGLang's offline engine ----------------------------------------------------------


def sglang_engine_args(target_dir: str, *, mem_fraction_static: float, seed: int) -> dict:
    """sglang.Engine(**these): token ids in and out, and no kernels that need extra packages or JIT."""
    return {
        "model_path": str(target_dir),
        "skip_tokenizer_init": True,  # prompts are token ids, replies are decoded here like the reference's
        "mem_fraction_static": mem_fraction_static,
        "random_seed": seed,
        "attention_backend": "triton",  # no FA3 on the hosts this runs on
        "sampling_backend": "pytorch",  # no flashinfer sampling kernels
        "grammar_backend": "none",  # no xgrammar; replies are unconstrained
        "disable_prefill_cuda_graph": True,  # as the tested SGLang server flags (`serve.extra_args` of the GPU examples)
        "log_level": "warning",  # the scheduler's own errors reach the stage log
    }


def sglang_sampling_params(*, max_new_tokens: int, temperature: float, eos: frozenset[int]) -> dict:
    """One request's sampling parameters; SGLang treats temperature 0 as greedy (top_k 1)."""
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": sorted(eos)}


@contextlib.contextmanager
def stage_logging_kept():
    """Give the stage its logging back after sglang.Engine(): the engine reconfigures the root
    logger (logging.basicConfig(force=True) at its own log_level, "error"), which would drop
    the stage's log file handler and its INFO lines."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


class SGLangEngine:
    """SGLang's offline engine; it owns scheduler subprocesses, so `close` must always run."""

    def __init__(self, target_dir: str, *, seed: int, mem_fraction_static: float, max_new_tokens: int,
                 temperature: float, eos: frozenset[int]):  # fmt: skip
        import sglang  # only here: the reference path runs without it

        with stage_logging_kept():
            self.engine = sglang.Engine(**sglang_engine_args(target_dir, mem_fraction_static=mem_fraction_static, seed=seed))
        self.sampling_params = sglang_sampling_params(max_new_tokens=max_new_tokens, temperature=temperature, eos=eos)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Output ids per prompt, all prompts in one call: SGLang schedules and batches them itself."""
        outputs = self.engine.generate(input_ids=prompts, sampling_params=self.sampling_params)
        return [out["output_ids"] for out in outputs]  # a list, in prompt order

    def close(self) -> None:
        self.engine.shutdown()


# -- specgate's reference decoder --------------------------------------------------------


def decode_refilling(decoder: SpecDecoder, requests: list[Request], slots: int) -> None:
    """Decode every request, at most `slots` at a time, with plain steps.

    A slot freed by a finished request takes the next waiting request before the next
    step, so the batch stays full until the queue runs dry; a static batch would run, ever
    emptier, until its longest reply ends. Requests start in the order given.
    """
    waiting, free, running = deque(requests), list(reversed(range(slots))), []
    while waiting or running:
        while free and waiting:
            req = waiting.popleft()
            req.slot = free.pop()
            decoder.prefill(req)
            running.append(req)
        for req in running:
            if req.done:
                free.append(req.slot)
        # In slot order: a full batch then covers consecutive slots, which the KV cache attends over
        # views, without the copy that gathers scattered ones.
        running = sorted((r for r in running if not r.done), key=lambda r: r.slot)
        if running:
            decoder.plain_step(running)


class ReferenceEngine:
    """specgate's decoder (no drafter) on the target's HF weights, on any device."""

    def __init__(self, target_dir: str, *, device: str, batch_size: int, max_new_tokens: int, temperature: float,
                 eos: frozenset[int]):  # fmt: skip
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").to(pick_device(device)).eval()
        self.runner = LlamaRunner(model)
        self.batch_size, self.max_new_tokens, self.temperature, self.eos = batch_size, max_new_tokens, temperature, eos
        self.decoder: SpecDecoder | None = None

    def _decoder_for(self, longest_prompt: int) -> SpecDecoder:
        # Sized by the prompts actually seen, not the input file: a regenerated reply can be longer
        # than the one it replaces, so later turns can outgrow the original conversations.
        need = longest_prompt + self.max_new_tokens + 1
        if self.decoder is None or self.decoder.target_cache.max_len < need:
            self.decoder = None  # frees the old cache before the larger one is allocated
            self.decoder = SpecDecoder(self.runner, None, slots=self.batch_size, max_len=need)
        return self.decoder

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Output ids per prompt; longest prompts first, so the last requests to start are short."""
        decoder = self._decoder_for(max(map(len, prompts)))
        reqs = [Request(0, p, self.max_new_tokens, self.eos, temperature=self.temperature) for p in prompts]
        decode_refilling(decoder, sorted(reqs, key=lambda r: -len(r.prompt)), self.batch_size)
        return [r.output for r in reqs]

    def close(self) -> None:
        self.decoder = None


# -- the stage --------------------------------------------------------------------------


def start_engine(engine: str, target_dir: str, *, seed: int, device: str, mem_fraction_static: float,
                 max_new_tokens: int, temperature: float, batch_size: int, eos: frozenset[int]):  # fmt: skip
    """The resolved engine, ready to generate; the caller closes it."""
    if engine == "sglang":  # batches by itself: batch_size is the reference decoder's
        return SGLangEngine(target_dir, seed=seed, mem_fraction_static=mem_fraction_static,
                            max_new_tokens=max_new_tokens, temperature=temperature, eos=eos)  # fmt: skip
    return ReferenceEngine(target_dir, device=device, batch_size=batch_size, max_new_tokens=max_new_tokens,
                           temperature=temperature, eos=eos)  # fmt: skip


def target_eos(target_dir: str, tokenizer) -> frozenset[int]:
    """`eos_ids` of the target without loading its weights (SGLang loads them itself).

    The target stage saves the model with save_pretrained, which writes generation_config.json."""
    from transformers import GenerationConfig

    return eos_ids(SimpleNamespace(generation_config=GenerationConfig.from_pretrained(target_dir)), tokenizer)


def parts_fingerprint(conversations: str, target_dir: str, *, engine: str, seed: int, chunk_size: int,
                      **settings) -> str:  # fmt: skip
    """What the parts depend on. The resolved engine is part of it: the two engines' replies differ
    (batching, kernels), so a part written by one is never reused by the other. mem_fraction_static
    only sizes SGLang's memory pool and does not change replies, so it is not."""
    return stable_hash({"data": sha256_file(conversations), "target": sha256_file(Path(target_dir) / "manifest.json"),
                        "seed": seed, "chunk": chunk_size, "engine": engine, **settings})  # fmt: skip


def regenerate_conversations(generate, tokenizer, records: list[dict],
                             max_prompt_tokens: int | None = None) -> tuple[list[dict], int, int]:  # fmt: skip
    """Regenerate assistant turns in order; a conversation ends at its first empty reply.

    `generate` maps token-id prompts to output ids. Each turn of all live conversations is
    one call. A conversation also ends before a turn whose prompt is `max_prompt_tokens` or
    longer: tokenize keeps no more than that, so the reply would never be trained on (and a
    long conversation could outgrow the target's context). Returns the conversations with at
    least one reply, how many had none, and how many tokens were generated.
    """
    users = [[m for m in r["messages"] if m["role"] == "user"] for r in records]
    done = [[m for m in r["messages"][:1] if m["role"] == "system"] for r in records]
    alive, tokens = list(range(len(records))), 0
    for turn in range(max(map(len, users), default=0)):
        alive = [i for i in alive if turn < len(users[i])]
        if not alive:
            break
        histories = [done[i] + [users[i][turn]] for i in alive]
        prompts = [prompt_ids(tokenizer, h) for h in histories]
        if max_prompt_tokens is not None:
            fits = [len(p) < max_prompt_tokens for p in prompts]
            alive, histories, prompts = ([x for x, ok in zip(xs, fits, strict=True) if ok] for xs in (alive, histories, prompts))
            if not alive:
                break
        outputs = generate(prompts)
        tokens += sum(map(len, outputs))
        survivors = []
        for i, history, ids in zip(alive, histories, outputs, strict=True):
            reply = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if reply:
                done[i] = history + [{"role": "assistant", "content": reply}]
                survivors.append(i)
        alive = survivors
    out = [{**r, "messages": d} for r, d in zip(records, done, strict=True) if any(m["role"] == "assistant" for m in d)]
    return out, len(records) - len(out), tokens


def regenerate_stage(conversations: str, target_dir: str, out: str, summary_out: str, *, seed: int, device: str,
                     engine: str = "auto", mem_fraction_static: float = 0.8, max_new_tokens: int,
                     temperature: float, batch_size: int, chunk_size: int, replicas: int = 1,
                     max_prompt_tokens: int | None = None) -> dict:  # fmt: skip
    """Regenerate the train split chunk by chunk, resuming at the first missing chunk.

    With `replicas` > 1 each conversation is regenerated that many times (sampled, so the copies differ),
    each copy after the first marked `"replica": k`.

    The summary's generated_tokens, generate_seconds and tokens_per_s count only the chunks
    generated by this call (chunks_generated), not those reused from an earlier run
    (chunks_reused); generate_seconds excludes loading the model or starting the engine.
    """
    from transformers import AutoTokenizer

    engine = resolve_engine(engine)
    records = read_jsonl(conversations)
    records = [r if k == 0 else {**r, "replica": k} for k in range(replicas) for r in records]
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "batch_size": batch_size}
    # only what is set: parts written without replicas or a prompt cap stay valid
    copies = {"replicas": replicas} if replicas > 1 else {}
    cap = {"max_prompt_tokens": max_prompt_tokens} if max_prompt_tokens is not None else {}
    fingerprint = parts_fingerprint(conversations, target_dir, engine=engine, seed=seed, chunk_size=chunk_size,
                                    **settings, **copies, **cap)  # fmt: skip
    parts = ShardDir(Path(out).with_suffix(".parts"), fingerprint)
    keep_freed_memory()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    eos = target_eos(target_dir, tokenizer)
    chunks = [records[i : i + chunk_size] for i in range(0, len(records), chunk_size)]
    kept, empty, generated, tokens, seconds = [], 0, 0, 0, 0.0
    gen = None  # started at the first missing chunk: a fully resumed run loads nothing
    try:
        for k, chunk in enumerate(tqdm(chunks, desc="regenerate", unit="chunk")):
            name = f"part_{k:05d}.jsonl"
            if not parts.done(name):
                if gen is None:
                    gen = start_engine(engine, target_dir, seed=seed, device=device, mem_fraction_static=mem_fraction_static,
                                       eos=eos, **settings)  # fmt: skip
                torch.manual_seed(seed + k)  # reference sampling is reproducible per chunk, also after a resume
                start = time.perf_counter()
                regenerated, n_empty, n_tokens = regenerate_conversations(gen.generate, tokenizer, chunk, max_prompt_tokens)
                seconds += time.perf_counter() - start
                generated, tokens = generated + 1, tokens + n_tokens
                write_jsonl(parts.path(name), regenerated + [{"_empty_replies": n_empty}])
            part = read_jsonl(parts.path(name))
            kept += part[:-1]
            empty += part[-1]["_empty_replies"]
    finally:
        if gen is not None:
            gen.close()
    write_jsonl(out, kept)
    summary = {"input": len(records), "kept": len(kept), "dropped_empty_reply": empty, "engine": engine, **settings,
               "replicas": replicas, "max_prompt_tokens": max_prompt_tokens,
               "chunks_generated": generated, "chunks_reused": len(chunks) - generated, "generated_tokens": tokens,
               "generate_seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / seconds, 1) if seconds else None}  # fmt: skip
    write_json(summary_out, summary)
    log.info("regenerated with %s: %d of %d kept; %s tokens in %s s, %s tokens/s (%d chunks generated, %d reused)",
             engine, summary["kept"], summary["input"], tokens, summary["generate_seconds"], summary["tokens_per_s"],
             generated, summary["chunks_reused"])  # fmt: skip
    return summary


def run_regenerate_job(conversations: str, target_dir: str, out: str, summary_out: str, **settings) -> dict | None:
    """The stage, run where SGLang's engine can start.

    SGLang starts its scheduler with multiprocessing's spawn, which re-imports the parent's
    `__main__`. A Snakemake script cannot be imported a second time (its `snakemake` object exists
    only in the first), so with SGLang the stage runs as `python -m specgate.pipeline.regenerate`."""
    job = dict(conversations=conversations, target_dir=target_dir, out=out, summary_out=summary_out, **settings)
    if resolve_engine(settings["engine"]) != "sglang":
        return regenerate_stage(**job)
    job_file = Path(out).with_suffix(".job.json")
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "specgate.pipeline.regenerate", "--job", str(job_file)]
    subprocess.run(cmd, check=True, stdout=inheritable_stream(sys.stdout), stderr=inheritable_stream(sys.stderr))
    job_file.unlink(missing_ok=True)
    return json.loads(Path(summary_out).read_text())


if __name__ == "__main__":
    worker_main(regenerate_stage)
