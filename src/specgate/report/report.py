"""results/report.md: what was built, from what, and what it measured.

Each stage contributes a section from its own summary file. The report is a pure
function of those files and a provenance record, so the archive can rebuild it
elsewhere (`specgate rebuild-report`) with identical tables.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from specgate import layout
from specgate.files import atomic_path, read_jsonl, write_json
from specgate.gate import RESUMED_STEPS
from specgate.report import cost_model as cm
from specgate.report import deploy
from specgate.report import plots
from specgate.report import sweep_tables as st
from specgate.report import uncertainty as un
from specgate.report.provenance import provenance as collect_provenance


def _json(path):
    return json.loads(Path(path).read_text())


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


STAGES = ["target", "data", "regenerate", "tokenize", "capture", "vocab", "train", "export", "drafter", "acceptance"]


def stage_times(bench_dir: Path, stages: list[str]) -> list[list]:
    """Wall time and peak memory of each stage of this config, from Snakemake's benchmark files."""
    rows = []
    for tsv in [bench_dir / f"{s}.tsv" for s in stages if (bench_dir / f"{s}.tsv").exists()]:
        with open(tsv) as f:
            rec = next(csv.DictReader(f, delimiter="\t"))
        rows.append([tsv.stem, f"{float(rec['s']):.1f}", f"{float(rec['max_rss']):.0f}"])
    return rows


def training_summary(metrics_csv: str, last: int = 20) -> str:
    with open(metrics_csv) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return "No training steps ran."
    steps = sorted(int(k.split("_")[1]) for k in rows[0] if k.startswith("acc_"))
    tail = rows[-last:]

    def mean(key, rs):
        return sum(float(r[key]) for r in rs) / len(rs)

    head = rows[: min(last, len(rows))]
    table = _table(["", "loss", *[f"acc_{k}" for k in steps], "τ̂", "tokens/s"], [
        [f"first {len(head)} steps", f"{mean('loss', head):.3f}", *[f"{mean(f'acc_{k}', head):.3f}" for k in steps],
         f"{mean('tau_hat', head):.3f}", f"{mean('tokens_per_s', head):.0f}"],
        [f"last {len(tail)} steps", f"{mean('loss', tail):.3f}", *[f"{mean(f'acc_{k}', tail):.3f}" for k in steps],
         f"{mean('tau_hat', tail):.3f}", f"{mean('tokens_per_s', tail):.0f}"],
    ])  # fmt: skip
    return f"{len(rows)} steps, {int(float(rows[-1]['epoch'])) + 1} epoch(s). Per-step metrics: `{metrics_csv}`.\n\n{table}"


def build_report(out: str, *, provenance_out: str, repo: str, config: dict, levels_out: str | None = None,
                 recommendation_out: str | None = None, **inputs) -> None:  # fmt: skip
    """The workflow's report job: record provenance, then write the report from it."""
    prov = collect_provenance(repo, config)
    summaries = [pd.read_csv(p) for p in inputs.get("bench_summaries", [])]
    if summaries:  # the engine that served the sweep, as the servers reported it
        first = pd.concat(summaries)
        prov["engine"] = str(first.engine.iloc[0])
        prov["server_version"] = str(first.server_version.iloc[0])
    write_json(provenance_out, prov)
    write_report(out, config=config, provenance=prov, levels_out=levels_out, recommendation_out=recommendation_out,
                 repo=repo, **inputs)  # fmt: skip


def write_report(out: str, *, config: dict, provenance: dict, target: str, data_summary: str, acceptance: str,
                 drafter: str, tokens_summary: str | None = None, capture_index: str | None = None,
                 vocab_summary: str | None = None, train_metrics: str | None = None,
                 bench_summaries: list[str] = (), regen_summary: str | None = None,
                 acceptance_unwidened: str | None = None, bench_records: list[str] = (),
                 levels_out: str | None = None, recommendation_out: str | None = None, stage_times_dir: str = layout.STAGE_TIMES,
                 plots_dir: str | None = None, repo: str | None = None) -> None:  # fmt: skip
    prov = provenance
    manifest = _json(Path(target) / "manifest.json")
    data = _json(data_summary)
    parts = [f"# specgate report: {config['run_name']}", "", "## Provenance", ""]
    parts.append(_table(["item", "value"], [
        ["git commit", f"{prov['commit']}{' (dirty)' if prov['dirty'] else ''}"],
        ["config hash", prov["config_hash"]],
        ["CPU", f"{prov['cpu']} ({prov['cpu_count']} logical cores)"],
        ["GPUs", ", ".join(prov["gpus"]) or "none"],
        ["serving engine", f"{prov.get('engine', '-')} (server version {prov.get('server_version', '-')})"],
        ["python", prov["python"]],
        *[[name, v] for name, v in prov["packages"].items() if v],
    ]))  # fmt: skip

    parts += ["", "## Target", ""]
    parts.append(_table(["architecture", "layers", "hidden", "vocab", "params", "dtype", "source"], [[
        manifest["architecture"], manifest["num_hidden_layers"], manifest["hidden_size"], manifest["vocab_size"],
        f"{manifest['num_parameters'] / 1e6:.1f} M", manifest["dtype"], manifest["source"]]]))  # fmt: skip
    if manifest.get("in_place"):
        rev = f" at revision {manifest['revision']}" if manifest.get("revision") else ""
        parts += ["", f"Served in place from `{manifest['path']}`{rev}: `{target}` links to its files (config "
                      f"sha256 {manifest['config_sha256'][:12]}); nothing was copied."]  # fmt: skip
    if "widened_from" in manifest:
        frm, to = manifest["widened_from"], manifest["widened_to"]
        parts += ["", f"Served widened (`target.widen`): the {frm['num_parameters'] / 1e6:.1f} M-parameter target "
                      f"({_shape(frm['shape'])}) padded to {_shape(to)}. It computes the same function at the larger "
                      "shape's step cost; data, capture and training used the target as it is, and the drafter was "
                      "widened the same way."]  # fmt: skip

    parts += ["", "## Data", ""]
    rows = []
    for name, s in data["sources"].items():
        rows.append([name, s["read"], sum(s["malformed"].values()), json.dumps(s["malformed"]) or "{}",
                     sum(s["repaired"].values()), sum(v for k, v in s["filtered"].items() if k != "turns_truncated_kept"),
                     s["duplicates"], s["train"], s["eval"]])  # fmt: skip
    parts.append(_table(["source", "read", "malformed", "malformed by reason", "repaired", "filtered", "duplicates", "train", "eval"], rows))
    if regen_summary:
        r = _json(regen_summary)
        parts += ["", f"Train answers regenerated by the target: {r['kept']} of {r['input']} kept "
                      f"({r['dropped_empty_reply']} empty replies dropped), max_new_tokens {r['max_new_tokens']}, "
                      f"temperature {r['temperature']}; written by {r['engine']} "
                      + (f"at {r['tokens_per_s']:,.0f} tok/s ({r['generated_tokens']:,} tokens generated in this run)."
                         if r["tokens_per_s"] else
                         f"(all {r['chunks_reused']} parts reused from an earlier run: no tokens generated in this one).")]  # fmt: skip
    if train_metrics:  # the drafter was trained here
        tokens, vocab = _json(tokens_summary), _json(vocab_summary)
        cap = _json(capture_index) if capture_index else None  # None: capture.mode online
        parts += ["", f"Tokenized: {tokens['sequences']} sequences, {tokens['tokens']} tokens, {tokens['loss_tokens']} "
                      f"under the loss mask; {tokens['truncated_to_max_length']} truncated to {tokens['max_length']}, "
                      f"skipped: {tokens['skipped']}."]  # fmt: skip

        parts += ["", "## Hidden-state capture", ""]
        if cap is None:
            parts.append("Online (`capture.mode: online`): the target computed the hidden states of each training batch "
                         "in the training loop; nothing was written to disk.")  # fmt: skip
        else:
            parts.append(_table(["layers (SGLang)", "HF hidden_states", "sequences", "tokens", "shards", "size", "dtype", "tok/s (last run)"], [[
                cap["layers_sglang"], cap["hidden_state_indices_hf"], cap["sequences"], cap["tokens"], len(cap["shards"]),
                f"{cap['bytes'] / 2**30:.2f} GiB", cap["dtype"], cap["last_run"]["tokens_per_s_rank0"]]]))  # fmt: skip

        parts += ["", "## Draft vocabulary", ""]
        parts.append(_table(["draft vocab", "target vocab", "distinct masked tokens", "coverage", "padded"], [[
            vocab["draft_vocab_size"], vocab["target_vocab_size"], vocab["distinct_masked_tokens"],
            f"{vocab['coverage']:.4f}", vocab["padded_with_unused_ids"]]]))  # fmt: skip

        parts += ["", "## Drafter training", "", training_summary(train_metrics)]
    drafter_cfg = _json(Path(drafter) / "config.json")
    origin = Path(drafter) / "origin.json"
    if not train_metrics:
        taken = _json(origin)["path"] if origin.exists() else config["drafter"]["path"]
        parts += ["", "## Drafter", "", f"Taken from `{taken}` (`drafter.path`), not trained here: data regeneration, "
                  "tokenize, capture, vocab and training did not run."]  # fmt: skip
    parts += ["", f"{'Exported to' if train_metrics else 'Served from'} `{drafter}` "
                  f"({drafter_cfg['draft_vocab_size']}-token draft vocabulary, aux layers "
                  f"{drafter_cfg['eagle_config']['eagle_aux_hidden_state_layer_ids']}); the SGLang contract check passed."]  # fmt: skip
    parts += ["", "## Acceptance length (offline, greedy)", ""]
    with open(acceptance) as f:
        acc_rows = list(csv.DictReader(f))
    parts.append(_table(["source", "k (draft steps)", "prompts", "verify steps", "τ measured",
                         "τ̂ from training, held-out replies decoded" if config["train"].get("heldout_sequences") else
                         "τ̂ from training, last steps", "τ̂ ÷ τ"],
                        [[r["source"], r["num_steps"], r["prompts"], r["verify_steps"], r["tau"],
                          f"{float(r['tau_hat_train']):.3f}" if r["tau_hat_train"] else "-",
                          f"{float(r['tau_hat_train']) / float(r['tau']):.3f}" if r["tau_hat_train"] else "-"]
                         for r in acc_rows]))  # fmt: skip
    if acceptance_unwidened:
        with open(acceptance_unwidened) as f:
            narrow = {(r["source"], r["num_steps"]): r for r in csv.DictReader(f)}
        rows = [[r["source"], r["num_steps"], narrow[(r["source"], r["num_steps"])]["tau"], r["tau"],
                 f"{float(r['tau']) / float(narrow[(r['source'], r['num_steps'])]['tau']):.4f}"]
                for r in acc_rows if (r["source"], r["num_steps"]) in narrow]  # fmt: skip
        parts += ["", "The same prompts on the target and drafter before widening (`" + acceptance_unwidened + "`):", "",
                  _table(["source", "k", "τ before widening", "τ widened", "ratio"], rows)]  # fmt: skip

    if plots_dir and train_metrics:
        plots.training(pd.read_csv(train_metrics), Path(plots_dir) / "training.png")
        parts += ["", f"![training curves]({_rel(plots_dir, out)}/training.png)"]
    sweep = decision = None
    if bench_summaries:
        blocks = pd.concat([pd.read_csv(p) for p in bench_summaries], ignore_index=True)
        rounds = un.replicates(blocks)
        records = pd.DataFrame([r for p in bench_records for r in read_jsonl(p)],
                               columns=["variant", "concurrency", "round", "output_tokens", "e2e_s", "error"])  # fmt: skip
        boot = un.bootstrap_levels(rounds, records, seed=int(config.get("seed", 0)))
        sweep = un.intervals(un.aggregate_rounds(rounds), boot, rounds)
        if {"nospec", "always"} <= set(sweep.variant):
            decision = un.decide(sweep, boot)
        parts += sweep_sections(config, sweep, plots_dir, out, decision, blocks=blocks)
        open_lines, open_best = st.open_loop_section(config, blocks)
        if open_lines:
            parts += open_lines
            if plots_dir:
                plots.latency_throughput(st.open_loop_cells(blocks), Path(plots_dir) / "latency_throughput.png")
                parts += ["", f"![latency against throughput]({_rel(plots_dir, out)}/latency_throughput.png)"]
        if levels_out:
            with atomic_path(levels_out) as tmp:
                sweep.to_csv(tmp, index=False)
    line = None
    if decision is not None:
        line = deploy.launch(config, decision, target, drafter, str(Path(out).with_suffix("")), prov.get("repo", repo))
    if recommendation_out:
        rec = decision.to_dict() if decision else {"verdict": None}
        if line is not None:
            rec["launch"] = line
        if bench_summaries:
            rec["open_loop_best"] = {f"{r:g}": b for r, b in open_best.items()}
            rec["block_noise"] = un.block_noise(st.closed(blocks))
        if decision is not None:  # the auto gate can start from this sweep's costs: specgate serve --auto-seed
            rec["auto_seed"] = cm.auto_seed(cm.fit(sweep)[0])
        write_json(recommendation_out, rec)

    stages = [s for s in STAGES if s != "regenerate" or regen_summary]
    if acceptance_unwidened:
        stages += ["widen", "acceptance_unwidened"]
    if sweep is not None:
        from specgate.sweep.bench import switched_jobs

        jobs = switched_jobs(config["bench"]) if config["bench"]["design"] == "switched" else sorted(sweep.variant.unique())
        stages += [f"bench_{v}.round{r}" for r in range(int(config["bench"]["rounds"])) for v in jobs]
    times = stage_times(Path(stage_times_dir), stages)
    if times:
        total = sum(float(r[1]) for r in times)
        parts += ["", "## Stage times (Snakemake benchmarks of the last run of each stage)", "",
                  _table(["stage", "wall s", "max RSS MB"], [*times, ["total", f"{total:.1f}", ""]])]  # fmt: skip
    if line is not None:
        parts += deploy.section(line)
    parts.append("")
    with atomic_path(out) as tmp:
        tmp.write_text("\n".join(parts))


def _shape(s: dict) -> str:
    return (f"hidden {s['hidden_size']}, {s['num_layers']} layers, MLP {s['intermediate_size']}, "
            f"{s['num_heads']} query / {s['num_kv_heads']} KV heads")


def _rel(plots_dir: str, out: str) -> str:
    import os

    return os.path.relpath(plots_dir, Path(out).parent)


def _fmt(x, digits=1):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _by_concurrency(summary: pd.DataFrame, column: str, variants: list[str], digits: int = 1) -> str:
    # a variant with no value at all (an auto gate that never speculated has no accept length) is a column of "-"
    table = summary.pivot_table(index="concurrency", columns="variant", values=column).reindex(columns=variants)
    return _table(["concurrency", *variants], [[c, *[_fmt(table.at[c, v], digits) for v in variants]] for c in table.index])


def gate_off_comparison(summary: pd.DataFrame) -> str | None:
    """Throughput ÷ no-spec above each threshold swept both ways: the true-off gate (gate_T) and
    SGLang's own 0-step path (steps0_T). None when the sweep has no such pair."""
    thr = summary.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    pairs = sorted(int(v.split("_")[1]) for v in thr.columns if v.startswith("steps0_") and f"gate_{v.split('_')[1]}" in thr)
    if "nospec" not in thr or not pairs:
        return None
    rows = [[t, c, _fmt(thr.at[c, "nospec"]), _fmt(thr.at[c, f"gate_{t}"] / thr.at[c, "nospec"], 3),
             _fmt(thr.at[c, f"steps0_{t}"] / thr.at[c, "nospec"], 3)]
            for t in pairs for c in thr.index if c >= 2 * t]  # fmt: skip
    if not rows:
        return None
    return _table(["threshold", "concurrency", "no-spec tok/s", "true-off gate ÷ no-spec", "SGLang steps=0 ÷ no-spec"], rows)


def auto_gate_section(summary: pd.DataFrame, decision: un.Decision) -> str:
    """Where the auto gate settled at each level, and how its throughput compares with the fixed thresholds'."""
    best = decision.best  # the fixed threshold with the highest envelope efficiency, as the recommendation ranks them
    thr = summary.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    by_variant = {v: summary[summary.variant == v].set_index("concurrency") for v in ("auto", best) if v}

    def value(c, key, variant="auto"):  # counts are summed over rounds; NaN where the server does not report one
        table = by_variant.get(variant)
        return table.at[c, key] if table is not None and key in table and c in table.index else np.nan

    def count(c, key):
        return "-" if pd.isna(value(c, key)) else f"{int(value(c, key)):,}"

    shares = un.speculated_share(summary)  # the same shares the recommendation compares gates on

    def speculated(c, variant):  # (text, share of decode steps speculated)
        if (variant, int(c)) not in shares:
            return "-", np.nan
        on, off = value(c, "gate_steps_on", variant), value(c, "gate_steps_off", variant)
        return f"{int(on):,} of {int(on + off):,}", shares[(variant, int(c))]

    rows, agree = [], []
    for c in sorted(by_variant["auto"].index):
        t = value(c, "auto_threshold")
        (steps, share), (best_steps, best_share) = speculated(c, "auto"), speculated(c, best)
        ratio = thr.at[c, "auto"] / thr.at[c, best] if best else np.nan
        if abs(share - best_share) <= un.SAME_DECISIONS:
            agree.append((c, ratio))
        rows.append([c, "none (speculates at every batch)" if pd.isna(t) else int(t), _fmt(thr.at[c, "auto"]),
                     _fmt(ratio, 3), steps, best_steps, count(c, "gate_switches"), count(c, "gate_probes"),
                     count(c, "gate_flushes")])  # fmt: skip
    auto_env = decision.envelope["auto"][0]
    spread = (f" [90% interval {decision.auto_ratio[1]:.3f}–{decision.auto_ratio[2]:.3f}]"
              if decision.auto_ratio else "")
    how = (f"It kept {auto_env:.3f} of the better of no-spec and always-on at every level, against {best}'s "
           f"{decision.envelope[best][0]:.3f} (ratio **{auto_env / decision.envelope[best][0]:.3f}**{spread})."
           if best else f"It kept {auto_env:.3f} of the better of no-spec and always-on at every level.")
    lines = ["The auto gate has no threshold: it measures a curve of step time against batch size for plain and "
             "for speculative steps, and the accept length, and stops speculating where speculation stops paying by that "
             f"model (`docs/design/auto-gate.md`). {how}",
             "",
             "Per level: the threshold it ran at the end of the level (median over rounds); decode steps speculated "
             "(auto's, and beside them the best fixed threshold's), switches, probes (each a few steps on the side "
             "the gate is not on) and true-off buffer flushes, summed over rounds.",
             "",
             _table(["concurrency", "threshold settled", "auto tok/s", f"÷ {best}" if best else "÷ best fixed",
                     "steps speculated", f"{best} speculated" if best else "best fixed speculated", "switches",
                     "probes", "flushes"], rows)]  # fmt: skip
    if best and agree:
        # servers that speculate on the same steps do the same work per step: there the ratio shows the
        # measurement's own spread, the yardstick for the envelope ratio
        ratios = [r for _, r in agree]
        lines += ["", f"At concurrency {', '.join(str(c) for c, _ in agree)} auto speculated on a share of decode steps "
                      f"within {un.SAME_DECISIONS * 100:.0f} points of {best}'s: there the two made nearly the same "
                      f"decisions, and auto ÷ {best} ran {min(ratios):.3f}–{max(ratios):.3f}."]  # fmt: skip
    return "\n".join(lines)


def sglang_adaptive_section(decision: un.Decision) -> str:
    """The best fixed gate (and auto) against SGLang's adaptive speculation as it ships, on envelope efficiency."""
    env = decision.envelope["sglang_adaptive"]
    rows = [[v, "{:.3f} [{:.3f}–{:.3f}]".format(*decision.envelope[v]), "**{:.3f}** [{:.3f}–{:.3f}]".format(*r),
             "beyond noise" if r[1] > 1 or r[2] < 1 else "within noise"] for v, r in decision.versus_sglang.items()]  # fmt: skip
    return "\n".join([
        "`sglang_adaptive` is SGLang's `--speculative-adaptive` with its default tiers: an accept-length EMA per "
        "batch-size range picks the draft steps, up to 7 at small batches and down to 0 (which still run the verify "
        "path) at large ones; "
        f"its server ran beside a no-spec server of its own. Its envelope efficiency: {env[0]:.3f} "
        f"[{env[1]:.3f}–{env[2]:.3f}].", "",
        _table(["variant", "envelope efficiency [90% interval]", "÷ sglang_adaptive's [90% interval]", ""], rows)])


def measured_crossing(decision: un.Decision, levels: list[int]) -> str:
    """Where the sweep places the crossover: between the first level at which always-on loses to no-spec
    beyond noise and the level below it. Medians alone would place it wherever noise first dips below 1."""
    if not decision.loses:
        return f"> {max(levels)} (lost at no level beyond noise)"
    first = min(decision.loses)
    below = [c for c in levels if c < first]
    return f"{max(below)}–{first}" if below else f"≤ {first}"


def _threshold(levels: pd.DataFrame, gate: str) -> int:
    return int(levels[levels.variant == gate].disable_at.iloc[0])


def rationale(summary: pd.DataFrame, decision: un.Decision, model: cm.CostModel) -> str:
    thr = summary.pivot_table(index="concurrency", columns="variant", values="output_throughput")
    lo, hi = thr.index.min(), thr.index.max()
    gain_lo, gain_hi = thr.at[lo, "always"] / thr.at[lo, "nospec"], thr.at[hi, "always"] / thr.at[hi, "nospec"]
    crossing = cm.measured_crossover(summary)
    gains = thr["always"] / thr["nospec"]
    if crossing == 0 and gains.max() > 1:  # behind at the lowest level, ahead at some higher one
        where = (f"always-on speculation is ×{gain_lo:.2f} no-spec at concurrency {lo}, ×{gains.max():.2f} at "
                 f"{gains.idxmax()} and ×{gain_hi:.2f} at {hi}")  # fmt: skip
    elif crossing == 0:
        where = f"always-on speculation never beat no speculation here (×{gain_lo:.2f} already at concurrency {lo})"
    elif math.isinf(crossing):
        where = f"always-on speculation beat no speculation at every measured concurrency (×{gain_hi:.2f} at {hi})"
    else:
        where = (f"always-on speculation is ×{gain_lo:.2f} no-spec at concurrency {lo} and ×{gain_hi:.2f} at {hi}, "
                 f"and the two curves cross at about {crossing:.1f} concurrent requests")  # fmt: skip
    pays = ", ".join(map(str, decision.pays)) or "none"
    loses = ", ".join(map(str, decision.loses)) or "none"
    noise = (f"Beyond noise (always-on ahead of no-spec in ≥ {100 - 5 / len(thr.index):.2f}% of bootstrap draws, or in "
             f"≤ 5%), speculation pays at concurrency {pays} and loses at {loses}.")  # fmt: skip
    pick, env = decision.pick, decision.envelope[decision.pick]
    keeps = (f"kept {env[0]:.3f} [{env[1]:.3f}–{env[2]:.3f}] of the better of no-spec and always-on at every measured "
             f"concurrency (worst at {decision.worst_concurrency[pick]}, mean {decision.mean_efficiency[pick]:.3f})")  # fmt: skip
    if len(decision.within_noise) > 1:
        tied = ", ".join(f"{g} ({decision.envelope[g][0]:.3f} [{decision.envelope[g][1]:.3f}–{decision.envelope[g][2]:.3f}])"
                         for g in decision.within_noise)  # fmt: skip
        rule = ("highest threshold, the gate that speculates furthest into the load where it paid"
                if decision.verdict == "no loss" else
                "lowest threshold, the gate that stops speculating first as load grows")  # as un.decide picks
        same = [f"{g} at c = {', '.join(map(str, decision.same_decisions[g]))}" for g in decision.within_noise
                if g != decision.best and decision.same_decisions.get(g)]  # fmt: skip
        apart = (f" (compared only where they decided apart; {decision.best} and {'; '.join(same)} speculated on the "
                 f"same share of steps)" if same else "")  # fmt: skip
        choice = f" **Within noise of each other: {tied}**{apart}. Among them the report picks the {rule}."
    else:
        others = sorted((g for g in decision.envelope if g.startswith("gate_") and g != pick),
                        key=lambda g: -decision.envelope[g][0])  # fmt: skip
        choice = (f" No other gate is within noise of it; the next best, {others[0]}, keeps "
                  f"{decision.envelope[others[0]][0]:.3f} [{decision.envelope[others[0]][1]:.3f}–"
                  f"{decision.envelope[others[0]][2]:.3f}]." if others else "")  # fmt: skip
    b = model.crossover()
    pred = ("the cost model predicts speculation pays at every batch size" if math.isinf(b) else
            "the cost model predicts speculation never pays" if b == 0 else
            f"the cost model (τ = {model.tau:.2f}) puts the crossover at batch {b:.1f}, i.e. a threshold of {model.threshold()}")  # fmt: skip
    t = _threshold(summary, pick)
    if decision.verdict == "no speculation":
        return (f"**Speculation lost beyond noise at every measured load: serve without it,** or, if it must stay on, "
                f"gate it at {t} running requests ({pick}), which {keeps}. With the drafter's measured accept length, "
                f"{where}. {noise}{choice} For comparison, {pred}.")  # fmt: skip
    if decision.verdict == "break-even":
        lost = (f" and lost beyond noise at c = {', '.join(map(str, decision.loses))}" if decision.loses else "")
        return (f"**Speculation does not pay here:** it won beyond noise at no measured load{lost}. If it stays on, gate "
                f"it at {t} running requests ({pick}), which {keeps}. With the drafter's measured accept length, "
                f"{where}. {noise}{choice} For comparison, {pred}.")  # fmt: skip
    if decision.verdict == "no loss":
        paid = ", ".join(map(str, decision.pays))
        return (f"**Speculation paid beyond noise at c = {paid} and lost at no measured load, up to concurrency {hi}: "
                f"gate it at {t} running requests ({pick}).** The sweep stopped below the load where speculation stops paying; sweep "
                f"higher concurrency to place the threshold there. With the drafter's measured accept length, {where}. "
                f"{noise} Gated at {t}, the server {keeps}.{choice} For comparison, {pred}.")  # fmt: skip
    return (f"**Stop speculating at {t} running requests ({pick}).** With the drafter's measured accept length, {where}. "
            f"{noise} Gated at {t}, the server {keeps}.{choice} For comparison, {pred}.")


def accept_title(summary: pd.DataFrame) -> str:
    sources = set(summary.accept_length_source.dropna())
    if sources == {"server counters, this level"}:
        return "Accept length per level (server counters over the level; '-' where the gate kept speculation off)"
    if "gate counters, speculative steps of this level" in sources:
        return ("Accept length per level: gated variants from the specgate plugin's counters (speculative steps of the "
                "level only; '-' where the gate kept speculation off), others the server's cumulative average")
    # SGLang exposes only its lifetime average, and counts every gate-off step as a 1-token verify
    return ("Accept length: the server's cumulative average at the end of each level (SGLang exposes no totals; "
            "on gated servers it includes gate-off steps, counted as 1)")


def resumed_section(summary: pd.DataFrame) -> list[str]:
    """Acceptance in the first speculative steps after the gate turns back on, against the same server's
    other speculative steps and against always-on: a draft that caught up badly over the tokens decoded
    while off shows here. Empty where no server counted such steps."""
    if "spec_verify_resumed" not in summary or not (summary.spec_verify_resumed.fillna(0) > 0).any():
        return []
    tau = cm.always_on_tau(summary)
    rows = []
    for v, g in summary[summary.spec_verify_resumed.fillna(0) > 0].groupby("variant", sort=False):
        n, k = g.spec_verify_resumed.sum(), g.spec_accepted_resumed.sum()
        rest_n, rest_k = g.spec_verify.sum() - n, g.spec_accepted.sum() - k
        resumed, rest = float(k / n), float(rest_k / rest_n) if rest_n else math.nan
        # a ratio over fewer request-steps than one resumption's window says nothing about catching up
        ratios = (resumed / rest, resumed / tau) if n >= RESUMED_STEPS else (math.nan, math.nan)
        rows.append([v, int(n), *(_fmt(x, 3) for x in (resumed, rest, *ratios))])
    return ["", "### Acceptance after the gate turns back on", "",
            f"Accept length over the first {RESUMED_STEPS} speculative steps after each off period (request-steps, "
            "summed over levels and rounds), over the same server's other speculative steps, and over always-on's "
            f"accept length (τ = {tau:.3f}, weighted by output tokens as in the cost model); ratios only over at "
            f"least {RESUMED_STEPS} request-steps. Near 1 means the draft caught up over the tokens decoded while off "
            "as well as if it had never stopped.", "",
            _table(["variant", "request-steps after resuming", "accept length after resuming", "other speculative steps",
                    "÷ other steps", "÷ always-on"], rows)]  # fmt: skip


def _with_interval(summary: pd.DataFrame, variants: list[str]) -> str:
    """Throughput medians over rounds with their 90% bootstrap interval."""
    idx = summary.set_index(["concurrency", "variant"])
    rows = []
    for c in sorted(summary.concurrency.unique()):
        cells = []
        for v in variants:
            r = idx.loc[(c, v)] if (c, v) in idx.index else None
            cells.append("-" if r is None else f"{r.output_throughput:.1f} [{r.output_throughput_lo:.1f}–{r.output_throughput_hi:.1f}]")
        rows.append([c, *cells])
    return _table(["concurrency", *variants], rows)


def sweep_sections(config: dict, summary: pd.DataFrame, plots_dir: str | None, out: str,
                   decision: un.Decision | None = None, blocks: pd.DataFrame | None = None) -> list[str]:  # fmt: skip
    variants = plots._variant_order(summary.variant.unique())
    serve = config["serve"]
    eng = summary.engine.iloc[0]
    parts = ["", "## Threshold sweep", "",
             f"Engine `{eng}` (server version {summary.server_version.iloc[0]}), {serve['num_steps']} draft steps, top-k 1; "
             + ("closed loop at each concurrency and open loop (Poisson arrivals) at each request rate"
                if config["bench"].get("request_rates") else "closed loop")
             + " over the OpenAI streaming API. " + st.describe(config, blocks if blocks is not None else summary),
             "", "### Output throughput (tok/s): median over blocks [90% bootstrap interval]", "",
             *(["A no-spec beside every block (the switched design's) is every ratio's denominator: its interval is the "
                "5th–95th percentile of its own blocks.", ""] if config["bench"].get("design") == "switched" else []),
             _with_interval(summary, variants),
             "", "### Median TTFT (ms)", "", _by_concurrency(summary, "median_ttft_ms", variants, 0),
             "", "### Median ITL (ms)", "", _by_concurrency(summary, "median_itl_ms", variants),
             "", "### p99 ITL (ms)", "", _by_concurrency(summary, "p99_itl_ms", variants),
             "", f"### {accept_title(summary)}", "", _by_concurrency(summary, "accept_length", [v for v in variants if v != "nospec"], 3),
             *resumed_section(summary),
             *(st.steadiness_section(blocks) + st.validity_section(blocks) if blocks is not None else []),
             "", f"Failed requests: {int(summary.failed.sum())} of "
             f"{int(summary.completed.sum() + summary.cancelled.fillna(0).sum() + summary.failed.sum())}."]  # fmt: skip
    if summary.errors.notna().any():
        parts += ["", "Errors: " + "; ".join(sorted(set(summary.errors.dropna())))]
    parts += gate_mode_line(summary)
    if plots_dir:
        plots.throughput(summary, Path(plots_dir) / "throughput.png")
        plots.latency(summary, Path(plots_dir) / "latency.png")
        rel = _rel(plots_dir, out)
        parts += ["", f"![throughput]({rel}/throughput.png)", "", f"![latency]({rel}/latency.png)"]

    if decision is None:
        return parts + ["", "The sweep lacks nospec or always: no envelope or recommendation."]
    eff = summary.groupby("variant")[["disable_at", "enable_at"]].first()
    model, steps = cm.fit(summary)
    concurrencies = sorted(summary.concurrency.unique())
    parts += ["", "## Envelope efficiency", "",
              "Per variant: the minimum over concurrencies of its throughput ÷ max(no-spec, always-on) at that concurrency, "
              "from the level medians, with its 90% bootstrap interval.", "",
              _table(["variant", "envelope efficiency [90% interval]", "worst at concurrency", "mean over concurrencies",
                      "cost model predicts"],
                     [[v, "{:.3f} [{:.3f}–{:.3f}]".format(*decision.envelope[v]), decision.worst_concurrency[v],
                       f"{decision.mean_efficiency[v]:.3f}",
                       f"{cm.predicted_envelope(model, concurrencies, int(eff.at[v, 'disable_at'])):.3f}"
                       if v.startswith("gate_") and pd.isna(eff.at[v, "enable_at"]) else "-"]
                      for v in variants])]  # fmt: skip
    if plots_dir:
        plots.envelope(summary, Path(plots_dir) / "envelope.png")
        parts += ["", f"![envelope]({_rel(plots_dir, out)}/envelope.png)"]
    if "auto" in decision.envelope:
        parts += ["", "### The auto gate", "", auto_gate_section(summary, decision)]
    if decision.versus_sglang:
        parts += ["", "### Against SGLang's own adaptive speculation", "", sglang_adaptive_section(decision)]
    off = gate_off_comparison(summary)
    if off:
        parts += ["", "### Gate off: specgate's true-off gate against SGLang's own 0-step path", "",
                  "At concurrency ≥ 2 × threshold the gate is off for most steps; throughput ÷ no-spec at the same level.",
                  "", off]  # fmt: skip

    pick = decision.pick
    parts += ["", "## Recommended threshold", ""]
    parts.append(rationale(summary, decision, model) if pick is not None else "No gated variant in the sweep.")

    thresholds = sorted({int(t) for t in eff.disable_at.dropna()})
    pred_best = max(thresholds, key=lambda t: cm.predicted_envelope(model, concurrencies, t)) if thresholds else None
    b = model.crossover()
    parts += ["", "## Cost model", "",
              "Effective step time from the sweep's own no-spec and always-on levels (client-side: concurrency × tokens per "
              "step ÷ output throughput, so prefill and scheduling are included), fitted as fixed + per-request × batch; "
              "see `specgate/cost_model.py`.", "",
              _table(["step", "fixed ms", "per request ms", "tokens per request per step"], [
                  ["plain (no-spec)", _fmt(model.plain.fixed * 1000, 2), _fmt(model.plain.per_request * 1000, 3), "1"],
                  [f"speculative (k={serve['num_steps']})", _fmt(model.spec.fixed * 1000, 2),
                   _fmt(model.spec.per_request * 1000, 3), f"τ = {model.tau:.3f}"]]), "",
              _table(["", "predicted", "measured"], [
                  ["crossover batch", "∞" if math.isinf(b) else f"{b:.1f}", measured_crossing(decision, concurrencies)],
                  ["threshold with the highest envelope efficiency, among those swept", pred_best if pred_best is not None else "-",
                   _threshold(summary, decision.best) if decision.best is not None else "-"]]), "",
              _table(["concurrency", "nospec measured", "nospec predicted", "always measured", "always predicted"], [
                  [c, _fmt(summary[(summary.variant == "nospec") & (summary.concurrency == c)].output_throughput.iloc[0]),
                   _fmt(float(model.nospec_throughput(c))),
                   _fmt(summary[(summary.variant == "always") & (summary.concurrency == c)].output_throughput.iloc[0]),
                   _fmt(float(model.spec_throughput(c)))] for c in concurrencies])]  # fmt: skip
    if plots_dir:
        plots.cost_model(model, steps, summary, Path(plots_dir) / "cost_model.png")
        parts += ["", f"![cost model]({_rel(plots_dir, out)}/cost_model.png)"]
    return parts


def gate_mode_line(summary: pd.DataFrame) -> list[str]:
    """The gate mode each gated variant ran, and on SGLang the adapter the true-off gate ran through."""
    if "gate_mode" not in summary or not summary.gate_mode.notna().any():
        return []
    modes = summary.dropna(subset=["gate_mode"]).groupby("gate_mode").variant.unique()
    adapters = set(summary.gate_adapter.dropna()) if "gate_adapter" in summary else set()

    def name(m: str) -> str:
        return f"{m} through the {' / '.join(sorted(adapters))} adapter" if m == "true-off" and adapters else m

    return ["", "Gate mode that ran: " + "; ".join(f"{name(m)} ({', '.join(sorted(v))})" for m, v in modes.items())
            + (". `sglang-steps0` is SGLang's own adaptive 0-step path, which the launcher falls back to where "
               "specgate's true-off gate does not fit the installed SGLang." if "sglang-steps0" in modes else ".")
            + (" `sglang-adaptive` is SGLang's own adaptive speculation with its default batch-size tiers, on a server "
               "of its own beside a no-spec server of its own." if "sglang-adaptive" in modes else "")]  # fmt: skip
