"""The true-off adapter's decisions, driven with stand-ins for SGLang's batch and worker objects.

The SGLang side (the decode graph, the forward, the draft extend) runs only on a GPU; these tests
cover what the adapter decides per step: which path a batch takes, when the draft catches up or
flushes, the host mirror of the sequence lengths, and the acceptance counters."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specgate.sglang.adapters import v0_5_15
from specgate.sglang.trueoff import TrueOffGate, unsupported


class Mode:
    def __init__(self, extend=False, idle=False):
        self.extend, self.idle = extend, idle

    def is_extend(self):
        return self.extend

    def is_idle(self):
        return self.idle


def make_batch(slots, lens, extend=False):
    return SimpleNamespace(
        forward_mode=Mode(extend=extend), is_extend_in_batch=False, reqs=list(slots),
        req_pool_indices=torch.tensor(slots), req_pool_indices_cpu=torch.tensor(slots),
        seq_lens=torch.tensor(lens), seq_lens_cpu=torch.tensor(lens), seq_lens_sum=sum(lens),
        return_logprob=False, has_grammar=False, return_hidden_states=False,
        spec_info=SimpleNamespace(bonus_tokens=torch.tensor(slots), topk_p=torch.zeros(len(slots), 1),
                                  future_indices=torch.tensor(slots)))  # fmt: skip


@pytest.fixture
def gate():
    g = TrueOffGate.__new__(TrueOffGate)
    g.init_state({"disable_at": 4, "buffer_tokens": 3}, pool=8, aux_dim=2,
                 dtype=torch.float32, device="cpu")  # fmt: skip
    g.worker = "worker"
    g.calls = []

    def plain_step(batch, slots_cpu, on_publish):  # what the real one does to the buffers
        g.buffers.append(slots_cpu, batch.spec_info.bonus_tokens, torch.ones(len(slots_cpu), 2))
        g.calls.append(("plain", len(batch.reqs)))
        return SimpleNamespace(kind="plain")

    def catch_up(batch, slots_cpu, resume):
        plan = g.buffers.plan(slots_cpu, batch.seq_lens_cpu.numpy())
        g.calls.append(("catch_up" if resume else "flush", plan.slots.tolist() if plan else []))
        if plan is not None:
            g.buffers.reset(plan.slots)

    g.plain_step, g.catch_up = plain_step, catch_up
    return g


def original(worker, batch, on_publish):
    return SimpleNamespace(kind="original")


def test_paths_catch_up_flush_and_mirror(gate):
    lens = {1: 10, 2: 20, 3: 30, 4: 5, 5: 7}
    gate.forward(original, make_batch([1, 2, 3], [10, 20, 30], extend=True), None)  # prefill
    assert gate.len_ok[[1, 2, 3]].all() and gate.len_cpu[[1, 2, 3]].tolist() == [10, 20, 30]

    out = gate.forward(original, make_batch([1, 2, 3], [10, 20, 30]), None)  # 3 < 4: speculate
    assert out.kind == "original" and not gate.len_ok[[1, 2, 3]].any()
    lens.update({1: 12, 2: 21, 3: 33})  # accept lengths, known to the host only later

    gate.forward(original, make_batch([4, 5], [5, 7], extend=True), None)  # two more requests
    for _ in range(4):  # 5 running: off; the buffers (3 tokens) fill up after three steps
        slots = [1, 2, 3, 4, 5]
        out = gate.forward(original, make_batch(slots, [lens[s] for s in slots]), None)
        assert out.kind == "plain"
        assert gate.len_cpu[slots].tolist() == [lens[s] + 1 for s in slots] and gate.len_ok[slots].all()
        for s in slots:
            lens[s] += 1
    assert ("flush", [1, 2, 3, 4, 5]) in gate.calls  # the fourth off step first empties the full rows
    assert gate.buffers.n_cpu[[1, 2, 3, 4, 5]].tolist() == [1] * 5

    out = gate.forward(original, make_batch([1, 2, 3], [lens[s] for s in (1, 2, 3)]), None)  # load falls: on
    assert out.kind == "original" and gate.calls[-1] == ("catch_up", [1, 2, 3])
    assert gate.buffers.n_cpu[[1, 2, 3]].tolist() == [0, 0, 0]
    assert gate.buffers.n_cpu[[4, 5]].tolist() == [1, 1]  # not in this batch: caught up when next seen
    c = gate.counters()
    assert (c["plain_steps"], c["original_steps"], c["switches"]) == (4, 2, 2)


def test_a_flush_takes_every_buffered_row_so_staggered_requests_share_it(gate):
    """Requests that arrive one by one fill their buffers (3 tokens here) on different steps: one
    flush empties them all, and the next comes only when a buffer fills again."""
    running, lens = [], {}

    def step(join=()):
        if join:
            gate.forward(original, make_batch(list(join), [10] * len(join), extend=True), None)
            running.extend(join)
            lens.update({s: 10 for s in join})
        assert gate.forward(original, make_batch(running, [lens[s] for s in running]), None).kind == "plain"
        for s in running:
            lens[s] += 1

    for join in ((0, 1, 2, 3), (4,), (5,), (6,), (7,), (), ()):  # >= 4 running: every step is off
        step(join)
    # rows 0-3 fill first; the flush also takes rows 4 and 5 (2 and 1 tokens), and the next flush
    # waits until a buffer fills again. Flushing full rows alone: 0-3, then 4, 5, 6 and 7 one by one.
    assert [c[1] for c in gate.calls if c[0] == "flush"] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert gate.buffers.n_cpu[running].tolist() == [1] * 8


def test_batches_with_logprobs_grammars_or_hidden_states_take_the_off_step_too(gate):
    gate.forward(original, make_batch([1, 2, 3, 4, 5], [9] * 5, extend=True), None)
    for extra in ("return_logprob", "has_grammar", "return_hidden_states"):
        batch = make_batch([1, 2, 3, 4, 5], [9] * 5)
        setattr(batch, extra, True)
        assert gate.forward(original, batch, None).kind == "plain"
    no_draft_state = make_batch([1, 2, 3, 4, 5], [9] * 5)
    no_draft_state.spec_info.topk_p = None  # before a request's first draft state: the original path
    assert gate.forward(original, no_draft_state, None).kind == "original"


def test_sync_free_seq_lens_only_after_prefill_or_off_steps(gate):
    waited = []
    fmap = SimpleNamespace(needs_cpu_seq_lens=True, publish_ready=SimpleNamespace(wait=lambda: waited.append(1)),
                           new_seq_lens_buf=torch.arange(100, 108))  # fmt: skip
    gate.forward(original, make_batch([2, 6, 7, 1], [4, 5, 6, 7], extend=True), None)
    for _ in range(2):
        gate.forward(original, make_batch([2, 6, 7, 1], [4, 5, 6, 7]), None)  # 4 running: off
    batch = make_batch([2, 6, 7, 1], [0, 0, 0, 0])
    batch.seq_lens_cpu = None
    assert gate.resolve_seq_lens(fmap, batch)
    assert batch.seq_lens_cpu.tolist() == [5, 6, 7, 8] and batch.seq_lens_sum == 26 and waited == [1]
    assert batch.seq_lens.tolist() == [102, 106, 107, 101]  # gathered on the device, as SGLang does
    gate.forward(original, make_batch([2, 6], [5, 6]), None)  # on: accept lengths unknown on the host
    assert not gate.resolve_seq_lens(fmap, make_batch([2, 6], [0, 0]))
    assert not gate.resolve_seq_lens(SimpleNamespace(needs_cpu_seq_lens=False), make_batch([7], [0]))


def test_acceptance_counts_speculative_steps_only(gate):
    for resumed, drafts, stride in ((True, 3, 4), (False, 1, 4), (False, 0, 1)):
        result = SimpleNamespace(speculative_num_draft_tokens=stride, num_correct_drafts=drafts, _specgate_resumed=resumed)
        gate.count_accepted(result, SimpleNamespace(reqs=[0, 1]))
    c = gate.counters()
    assert (c["accept_length_resumed"], c["accept_length_steady"], c["accept_length_on"]) == (2.5, 1.5, 2.0)


def test_unsupported_settings_and_targets_are_named():
    mr = SimpleNamespace(mambaish_config=None, is_hybrid_swa=False, sliding_window_size=None, model_is_mrope=False,
                         model_config=SimpleNamespace(is_multimodal=False), use_mla_backend=False)  # fmt: skip
    worker = SimpleNamespace(adaptive_controller=None, server_args=SimpleNamespace(speculative_eagle_topk=1),
                             speculative_algorithm=SimpleNamespace(is_eagle3=lambda: True),
                             target_worker=SimpleNamespace(model_runner=mr))  # fmt: skip
    assert unsupported(worker, None, v0_5_15) is None
    worker.adaptive_controller = object()
    assert "--speculative-adaptive" in unsupported(worker, None, v0_5_15)
    worker.adaptive_controller, worker.server_args.enable_mixed_chunk = None, True
    assert unsupported(worker, None, v0_5_15) == "mixed chunked prefill"
    worker.server_args.enable_mixed_chunk = False
    for obj, key, value, why in [(worker.server_args, "disaggregation_mode", "decode", "PD disaggregation"),
                                 (worker.server_args, "enable_streaming_session", True, "streaming sessions"),
                                 (mr, "mambaish_config", object(), "mamba/GDN"),
                                 (mr, "sliding_window_size", 4096, "sliding-window"),
                                 (mr, "model_is_mrope", True, "mrope"), (mr.model_config, "is_multimodal", True, "multimodal"),
                                 (mr, "use_mla_backend", True, "MLA")]:  # fmt: skip
        before = getattr(obj, key, None)
        setattr(obj, key, value)
        assert why in unsupported(worker, None, v0_5_15)
        setattr(obj, key, before if before is not None or key != "disaggregation_mode" else "null")
    worker.server_args.tp_size = 2  # a fixed threshold is the same on every rank; the auto gate's timings are not
    assert unsupported(worker, {"disable_at": 4}, v0_5_15) is None
    assert "auto gate with tensor parallelism" in unsupported(worker, {"auto": {}}, v0_5_15)


def test_server_info_carries_the_counters_and_the_client_takes_level_deltas(gate, monkeypatch):
    import specgate.sglang.trueoff as trueoff
    from specgate.sweep.load_client import accept_length, gate_counters

    hooks = trueoff.make_hooks({"disable_at": 4}, v0_5_15)
    info_hook = hooks[v0_5_15.TARGETS["get_internal_state"]]
    original = lambda self, req: SimpleNamespace(internal_state={"avg_spec_accept_length": 1.1})  # noqa: E731
    monkeypatch.setattr(trueoff, "_ACTIVE", None)
    assert "specgate_gate" not in info_hook(original, "scheduler", "req").internal_state
    monkeypatch.setattr(trueoff, "_ACTIVE", gate)

    def server_info():
        return {"internal_states": [info_hook(original, "scheduler", "req").internal_state]}

    before = server_info()
    gate.forward(lambda *a: SimpleNamespace(kind="original"), make_batch([1, 2], [5, 6]), None)  # on: 2 < 4
    gate.count_accepted(SimpleNamespace(speculative_num_draft_tokens=4, num_correct_drafts=3, _specgate_resumed=False),
                        SimpleNamespace(reqs=[1, 2]))  # fmt: skip
    after = server_info()
    assert gate_counters(after)["steps_on"] - gate_counters(before)["steps_on"] == 1
    assert accept_length(before, after) == (2.5, "gate counters, speculative steps of this level")
    assert accept_length({}, {"internal_states": [{"avg_spec_accept_length": 1.3}]}) == (1.3, "server cumulative average")


def test_catch_up_lengths_come_from_the_host_mirror_when_the_batch_has_none(gate):
    # triton keeps no host copy of seq_lens in spec v2: rows admitted while off still have exact lengths
    gate.forward(original, make_batch([1, 2, 3, 4], [10, 20, 30, 40], extend=True), None)
    no_host = make_batch([1, 2, 3, 4], [10, 20, 30, 40])
    no_host.seq_lens_cpu = None
    gate.forward(original, no_host, None)  # 4 running: off, one token each
    nxt = make_batch([1, 2, 3, 4], [11, 21, 31, 41])
    nxt.seq_lens_cpu, nxt.seq_lens = None, None  # a device read would fail here
    assert gate.host_seq_lens(nxt, np.array([1, 2, 3, 4])).tolist() == [11, 21, 31, 41]
    gate.len_ok[2] = False  # a row whose last step speculated has no exact host length
    nxt.seq_lens = torch.tensor([11, 21, 31, 41])
    assert gate.host_seq_lens(nxt, np.array([1, 2, 3, 4])).tolist() == [11, 21, 31, 41]  # read from the device


def test_the_mirror_check_stops_on_a_difference(gate):
    gate.check_mirror_every = 2
    device = torch.arange(100, 108)
    fmap = SimpleNamespace(needs_cpu_seq_lens=True, publish_ready=None, new_seq_lens_buf=device)
    gate.forward(original, make_batch([2, 3, 4, 5], [4, 5, 6, 7], extend=True), None)
    for _ in range(2):
        gate.forward(original, make_batch([2, 3, 4, 5], [4, 5, 6, 7]), None)  # off: the mirror says 5..8
    device[[2, 3, 4, 5]] = torch.tensor([5, 6, 7, 8])
    assert gate.resolve_seq_lens(fmap, make_batch([2, 3, 4, 5], [0] * 4))  # 1st resolve: not checked
    assert gate.resolve_seq_lens(fmap, make_batch([2, 3, 4, 5], [0] * 4)) and gate.mirror_checks == 1  # agrees
    gate.resolve_seq_lens(fmap, make_batch([2, 3, 4, 5], [0] * 4))
    device[4] = 99
    with pytest.raises(RuntimeError, match="slot 4: mirror 7 device 99"):
        gate.resolve_seq_lens(fmap, make_batch([2, 3, 4, 5], [0] * 4))


def test_a_released_slot_starts_clean_and_a_finishing_request_keeps_only_extended_tokens(gate):
    gate.forward(original, make_batch([1, 2, 3, 4], [10, 20, 30, 40], extend=True), None)
    gate.forward(original, make_batch([1, 2, 3, 4], [10, 20, 30, 40]), None)  # off: one token buffered each
    gate.forward(original, make_batch([1, 2, 3, 4], [11, 21, 31, 41]), None)
    assert gate.commit_len(2, 22, protected=5) == 20  # two tokens without draft KV stay out of the prefix cache
    # SGLang asks again for the over-allocated range: the same answer, counted once
    assert gate.commit_len(2, 22, protected=5, count=False) == 20 and (gate.trimmed_requests, gate.trimmed_tokens) == (1, 2)
    # never down to the cached prefix itself: SGLang frees the last kept token (a use-after-free if the cache owns it)
    assert gate.commit_len(2, 22, protected=21, count=False) == 22
    assert gate.commit_len(2, 22, protected=19, count=False) == 20
    gate.release(2)
    assert gate.buffers.n_cpu[2] == 0 and not gate.len_ok[2] and gate.commit_len(2, 22, protected=5) == 22
    assert gate.buffers.n_cpu[[1, 3, 4]].tolist() == [2, 2, 2]


def test_the_auto_gate_in_sglang_times_each_decode_step_alone_and_counts_accepted_tokens(monkeypatch):
    """A speculative step takes 30 ms and a plain one 10 ms, with a second between steps (the host, a
    prefill): the gate's estimates are the steps' own times, whatever ran between them."""
    from specgate.gate import AutoGate
    from specgate.sweep.load_client import gate_counters, settled_threshold

    now = [0.0]
    monkeypatch.setattr("specgate.sglang.step_timer.time.perf_counter", lambda: now[0])

    def timed(kind, seconds):
        def step(*args):
            now[0] += seconds
            return SimpleNamespace(kind=kind)
        return step

    g = TrueOffGate.__new__(TrueOffGate)
    g.init_state({"auto": {"probe_every": 5, "probe_len": 4}}, pool=8, aux_dim=2, dtype=torch.float32, device="cpu")
    g.worker, g.plain_step, g.catch_up = "worker", timed("plain", 0.010), lambda *a, **k: None
    assert isinstance(g.gate, AutoGate)
    speculative = timed("original", 0.025)
    g.forward(speculative, make_batch([1, 2, 3, 4], [10] * 4, extend=True), None)
    sides = []
    for _ in range(11):
        now[0] += 1.0
        out = g.forward(speculative, make_batch([1, 2, 3, 4], [10] * 4), None)
        sides.append(out.kind)
        if out.kind == "original":  # the accepted tokens reach the gate when the result is processed
            g.count_accepted(SimpleNamespace(speculative_num_draft_tokens=4, num_correct_drafts=8, _specgate_resumed=False),
                             SimpleNamespace(reqs=[1, 2, 3, 4]))  # fmt: skip
    # no threshold yet: it speculates; the fifth step starts a probe of four plain steps (free: plain steps were
    # never timed at this batch), after which the model has both sides
    assert sides == ["original"] * 4 + ["plain"] * 4 + ["original"] * 3
    assert g.gate.tau == 3.0  # (8 correct + 4 bonus) / 4 requests
    lines = g.gate.lines
    assert lines["spec"](4) == pytest.approx(0.025) and lines["plain"](4) == pytest.approx(0.010)
    assert g.gate.gain(4) == pytest.approx(1.2)  # 3 tokens per 25 ms against 1 per 10 ms
    assert g.gate.threshold is None  # it pays at every batch: the gate stays on
    # the sweep reads the threshold it settled on from the plugin's entry in SGLang's internal states
    counters = g.counters()
    assert counters["mode"] == "true-off" and "auto_threshold" in counters
    info = {"internal_states": [{"specgate_gate": counters}]}
    assert settled_threshold(gate_counters(info)) == g.gate.threshold
    # a speculative step that first catches the draft up (here for a second) is not a speculative step's time
    g.catch_up = lambda *a, **k: now.__setitem__(0, now[0] + 1.0)
    # typical steps on the side, two with a catch-up, one more; a step's time reaches the gate at the next step
    for i, pending in enumerate((False, False, True, True, False)):
        if pending:
            g.buffers.append(np.array([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4]), torch.ones(4, 2))
        assert g.forward(speculative, make_batch([1, 2, 3, 4], [10] * 4), None).kind == "original"
        if i == 2:
            n_spec = sum(w for w, _, _ in lines["spec"].buckets.values())  # the typical steps are in
    assert sum(w for w, _, _ in lines["spec"].buckets.values()) == n_spec and lines["spec"](4) == pytest.approx(0.025)


def test_first_and_slow_step_times_reach_the_log(caplog):
    """A cost paid once (a first use) is logged with its side and batch size; ordinary steps are not."""
    g = TrueOffGate.__new__(TrueOffGate)
    g.init_state({"disable_at": 4}, pool=8, aux_dim=2, dtype=torch.float32, device="cpu")
    with caplog.at_level("INFO", logger="specgate.gate"):
        for seconds in (0.180, 0.007, 0.008, 0.007):
            g.note_time(1, True, seconds)
        g.note_time(1, False, 0.005)
        g.note_time(1, True, None)  # an untimed step (a catch-up) says nothing
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["specgate step time: spec at batch 1, 180.00 ms (first timed)",
                     "specgate step time: plain at batch 1, 5.00 ms (first timed)"]  # fmt: skip
    g.note_time(1, True, 0.030)  # over 4x the fastest (7 ms)
    with caplog.at_level("INFO", logger="specgate.gate"):
        g.note_time(1, True, 0.030)
    assert caplog.records[-1].getMessage() == "specgate step time: spec at batch 1, 30.00 ms (4.3x the fastest)"


def test_a_control_file_switches_the_gate_between_steps_and_each_setting_keeps_its_state(tmp_path):
    from specgate.gate_control import write_control

    control = tmp_path / "gate_control.json"
    g = TrueOffGate.__new__(TrueOffGate)
    g.init_state({"disable_at": None, "control": str(control)}, pool=8, aux_dim=2, dtype=torch.float32, device="cpu")
    g.worker, g.calls = "worker", []
    g.plain_step = lambda batch, slots_cpu, on_publish: SimpleNamespace(kind="plain")
    g.catch_up = lambda batch, slots_cpu, resume: g.buffers.reset(slots_cpu)
    slots = [1, 2, 3]
    g.forward(original, make_batch(slots, [10, 20, 30], extend=True), None)
    assert g.forward(original, make_batch(slots, [10, 20, 30]), None).kind == "original"  # always on
    assert g.counters()["control_generation"] == 0
    write_control(control, 1, {"disable_at": 2})
    assert g.forward(original, make_batch(slots, [11, 21, 31]), None).kind == "plain"  # batch 3 >= 2: off
    first = g.gate
    assert g.counters()["control_generation"] == 1 and g.counters()["disable_at"] == 2
    write_control(control, 2, {"disable_at": None})
    assert g.forward(original, make_batch(slots, [12, 22, 32]), None).kind == "original"
    write_control(control, 3, {"disable_at": 2})
    g.forward(original, make_batch(slots, [13, 23, 33]), None)
    assert g.gate is first and g.gate.steps_off == 2  # the same setting: the same gate, its counts carried on
    control.write_text("not json")  # a bad file changes nothing
    assert g.forward(original, make_batch(slots, [14, 24, 34]), None).kind == "plain"
    assert g.counters()["control_generation"] == 3
    # the timed steps, by side, for the sweep's per-block step figures (off the GPU: the host clock)
    counts = g.counters()["step_counters"]
    assert counts["spec"][0] >= 1 and counts["plain"][0] >= 1 and counts["plain"][1] == 3 * counts["plain"][0]
