"""EAGLE-3 chain speculative decoding (top-k 1), with the semantics of SGLang's EAGLE-3 worker.

Per request, after the target has produced token x_n (not yet in its KV cache):
  draft    d_1 comes from the last draft-extend; d_2..d_k from k-1 draft steps, each fed
           the previous step's pre-norm output and the previous draft token
  verify   the target runs [x_n, d_1..d_k] (k+1 tokens) and accepts the longest prefix
           of drafts equal to its own greedy choices, plus one bonus token
  extend   draft KV is cut back to the verified prefix and extended over the accepted
           tokens with the target's aux hidden states, which yields the next d_1
A plain step (speculation off) runs the target on x_n alone and still extends the draft
by that one token, so the draft KV never goes stale. Greedy output is therefore the
same whichever steps are taken. This is the step logic the serving engine reuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specgate.model.drafter import Eagle3Drafter
from specgate.model.llama import KVCache, LlamaRunner


@dataclass
class Request:
    slot: int
    prompt: list[int]
    max_new_tokens: int
    eos_ids: frozenset = frozenset()
    ignore_eos: bool = False
    temperature: float = 0.0  # > 0 samples; plain steps only (speculative steps are greedy)
    output: list[int] = field(default_factory=list)
    draft_next: int | None = None  # d_1 for the next speculative step (target id)
    draft_state: torch.Tensor | None = None  # pre-norm output of the last draft-extend position
    verify_steps: int = 0
    accepted_tokens: int = 0  # tokens verify steps added to the output (accepted drafts + bonus, up to EOS)
    # Positions not yet extended into the draft KV (the gate was off): the target's aux hidden
    # states [1, n, 3H] and the next tokens [1, n]. Drafting resumes only after a catch-up extend.
    behind_aux: list[torch.Tensor] = field(default_factory=list)
    behind_tokens: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        if len(self.output) >= self.max_new_tokens:
            return True
        return bool(self.output) and not self.ignore_eos and self.output[-1] in self.eos_ids

    def emit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to max_new_tokens or EOS; return what was appended."""
        out = []
        for t in tokens:
            if self.done:
                break
            self.output.append(t)
            out.append(t)
        return out


def _slots(reqs: list[Request]) -> torch.Tensor:
    """The requests' KV slots, on the host: the caches index with them, and no step waits on them."""
    return torch.tensor([r.slot for r in reqs])


def pick(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Next token per row: greedy, or sampled at the request's temperature."""
    out = logits.argmax(-1)
    for i, r in enumerate(reqs):
        if r.temperature > 0:
            out[i] = torch.multinomial(torch.softmax(logits[i].float() / r.temperature, -1), 1)[0]
    return out


class DraftRunner:
    """The drafter with its own one-layer KV cache in the same slots as the target."""

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Embedding, slots: int, max_len: int):
        self.drafter = drafter.eval()
        self.embed = embed
        attn = drafter.midlayer.self_attn
        dtype = next(drafter.parameters()).dtype
        self.cache = KVCache(1, slots, attn.num_kv_heads, max_len, attn.head_dim, dtype, self.embed.weight.device)
        self.dtype = dtype

    @torch.inference_mode()
    def step(self, slots: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor, last: torch.Tensor | None = None):
        """Run positions lengths[slot].. for tokens [B, n]; return (pre-norm out [B, H], draft id [B]) at each
        row's last position, or at position `last[b]` of row b when rows are padded to a common n."""
        positions = self.cache.lengths[slots][:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        q, k, v, residual = self.drafter.begin(hidden.to(self.dtype), self.embed(tokens).to(self.dtype), positions)
        out = self.drafter.end(self.cache.attend(0, slots, q, k, v), residual)
        self.cache.advance(slots, tokens.shape[1])
        picked = out[:, -1] if last is None else out[torch.arange(out.shape[0], device=out.device), last]
        return picked, self.drafter.logits(picked).argmax(-1)


class SpecDecoder:
    """Greedy decoding for a batch of requests, speculative or plain step by step."""

    def __init__(self, target: LlamaRunner, drafter: Eagle3Drafter | None, slots: int, max_len: int,
                 catch_up_window: int = 256):  # fmt: skip
        self.catch_up_window = catch_up_window  # buffered positions per request before a forced extend
        self.target = target
        self.device = target.device  # token ids go where the weights are; slots stay on the host
        self.target_cache = target.new_cache(slots, max_len)
        self.draft = DraftRunner(drafter, target.body.embed_tokens, slots, max_len) if drafter is not None else None

    # -- helpers ------------------------------------------------------------------

    def _ids(self, rows) -> torch.Tensor:
        return torch.tensor(rows, device=self.device)

    def _draft_extend(self, reqs: list[Request], aux: torch.Tensor, next_tokens: torch.Tensor,
                      valid: list[int] | None = None) -> None:  # fmt: skip
        """Extend each request's draft KV over positions with target aux [B, n, 3H] and tokens [B, n].

        valid[b] < n: row b has only its first valid[b] positions; the rest is padding, which no
        valid position can attend to (causal) and which is cut from the draft KV afterwards."""
        slots = _slots(reqs)
        if valid is None:
            state, draft_ids = self.draft.step(slots, aux, next_tokens)
        else:
            base = self.draft.cache.lengths[slots].clone()
            state, draft_ids = self.draft.step(slots, aux, next_tokens, last=self._ids([v - 1 for v in valid]))
            self.draft.cache.truncate(slots, base + self._ids(valid))
        target_ids = self.draft.drafter.to_target_ids(draft_ids).tolist()
        for i, r in enumerate(reqs):
            r.draft_state, r.draft_next = state[i : i + 1], target_ids[i]

    def _defer_draft(self, reqs: list[Request], aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Buffer positions for a later catch-up instead of extending the draft now (gate off)."""
        for i, r in enumerate(reqs):
            r.behind_aux.append(aux[i : i + 1])
            r.behind_tokens.append(next_tokens[i : i + 1])
        full = [r for r in reqs if sum(t.shape[1] for t in r.behind_tokens) >= self.catch_up_window]
        if full:  # bounded memory: a request far behind catches up now
            self.catch_up(full)

    def catch_up(self, reqs: list[Request]) -> None:
        """Bring each request's draft KV up to date with one extend over its buffered positions."""
        for r in reqs:
            if r.behind_tokens:
                aux, tokens = torch.cat(r.behind_aux, dim=1), torch.cat(r.behind_tokens, dim=1)
                r.behind_aux, r.behind_tokens = [], []
                self._draft_extend([r], aux, tokens)

    # -- the three operations -----------------------------------------------------

    def prefill(self, req: Request, sync_draft: bool = True) -> None:
        """Run the prompt, emit the first token, and prime the draft (now, or at the next catch-up)."""
        self.target_cache.lengths[req.slot] = 0
        slots = _slots([req])
        ids = self._ids([req.prompt])
        logits, aux = self.target.forward(ids, self.target_cache, slots, logits_for="last")
        first = int(pick(logits[:, -1], [req])[0])
        req.emit([first])
        if self.draft is not None:
            self.draft.cache.lengths[req.slot] = 0
            req.behind_aux, req.behind_tokens = [], []
            shifted = self._ids([req.prompt[1:] + [first]])
            (self._draft_extend if sync_draft else self._defer_draft)([req], aux, shifted)

    def plain_step(self, reqs: list[Request], sync_draft: bool = True) -> None:
        """One target token per request. With sync_draft the draft KV follows by a one-token extend;
        without it (the gate is off) no draft work runs: the aux states wait for `catch_up`."""
        slots = _slots(reqs)
        last = self._ids([[r.output[-1]] for r in reqs])
        logits, aux = self.target.forward(last, self.target_cache, slots)
        nxt = pick(logits[:, -1], reqs)
        for r, t in zip(reqs, nxt.tolist()):
            r.emit([t])
        if self.draft is not None:
            if sync_draft:
                self.catch_up(reqs)
                self._draft_extend(reqs, aux, nxt[:, None])
            else:
                self._defer_draft(reqs, aux, nxt[:, None])

    def spec_step(self, reqs: list[Request], num_steps: int) -> None:
        """Draft num_steps tokens per request, verify them in one target pass, accept a prefix."""
        k = num_steps
        self.catch_up(reqs)  # requests the gate left behind: one extend each over their buffered positions
        slots = _slots(reqs)
        # draft chain: d_1 is known; d_2..d_k from k-1 steps at positions P+1..P+k-1
        drafts = [[r.draft_next] for r in reqs]
        base_draft_len = self.draft.cache.lengths[slots].clone()
        state = torch.cat([r.draft_state for r in reqs])
        for _ in range(k - 1):
            tokens = self._ids([[d[-1]] for d in drafts])
            state, draft_ids = self.draft.step(slots, state[:, None], tokens)
            for d, t in zip(drafts, self.draft.drafter.to_target_ids(draft_ids).tolist()):
                d.append(t)
        self.draft.cache.truncate(slots, base_draft_len)  # chain KV is never kept
        # verify [x_n, d_1..d_k]
        base_len = self.target_cache.lengths[slots].clone()
        ids = self._ids([[r.output[-1]] + d for r, d in zip(reqs, drafts)])
        logits, aux = self.target.forward(ids, self.target_cache, slots)
        greedy = logits.argmax(-1).tolist()  # greedy[i][j] is the target's token after ids[i][: j + 1]
        accepted = []
        for r, d, g in zip(reqs, drafts, greedy):
            a = 0
            while a < k and d[a] == g[a]:
                a += 1
            accepted.append(a)
            r.verify_steps += 1
            # what the request keeps: drafts accepted past its EOS or max_new_tokens are no output, so no acceptance
            r.accepted_tokens += len(r.emit(d[:a] + [g[a]]))
        # keep x_n and the accepted drafts in the target KV; extend the draft over them
        keep = self._ids(accepted) + 1
        self.target_cache.truncate(slots, base_len + keep)
        # one batched draft extend over the accepted spans, padded to the longest (rows differ in length)
        n = max(accepted) + 1
        spans = [drafts[i][:a] + [greedy[i][a]] * (n - a) for i, a in enumerate(accepted)]
        self._draft_extend(reqs, aux[:, :n], self._ids(spans), valid=[a + 1 for a in accepted])


def generate(decoder: SpecDecoder, req: Request, num_steps: int | None) -> Request:
    """Decode one request to completion: speculative with num_steps drafts, or plain when None/0."""
    decoder.prefill(req)
    while not req.done:
        if num_steps:
            decoder.spec_step([req], num_steps)
        else:
            decoder.plain_step([req])
    return req


def generate_batch(decoder: SpecDecoder, reqs: list[Request], num_steps: int | None,
                   timing: dict | None = None) -> list[Request]:  # fmt: skip
    """Decode several requests together (one slot each) until all are done.

    `timing`, if given, accumulates prefill_s, decode_s and batched steps (wall time: every step
    ends in a host read of its tokens, so the clock sees the device's work)."""
    t0 = time.perf_counter()
    for r in reqs:
        decoder.prefill(r)
    t1, steps = time.perf_counter(), 0
    while live := [r for r in reqs if not r.done]:
        if num_steps:
            decoder.spec_step(live, num_steps)
        else:
            decoder.plain_step(live)
        steps += 1
    if timing is not None:
        for key, value in (("prefill_s", t1 - t0), ("decode_s", time.perf_counter() - t1), ("steps", steps)):
            timing[key] = timing.get(key, 0) + value
    return reqs


def load_drafter(draft_dir: str, device="cpu", dtype=None) -> Eagle3Drafter:
    """An exported drafter (config.json + model.safetensors) as an Eagle3Drafter."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(draft_dir)
    drafter = Eagle3Drafter(cfg)
    drafter.load_state_dict(load_file(f"{draft_dir}/model.safetensors"), strict=True)
    return drafter.to(device=device, dtype=dtype or torch.float32).eval()
