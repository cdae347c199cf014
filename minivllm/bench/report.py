"""Presenting results: vLLM-style text blocks, the compare report in Markdown, and its plots."""
from __future__ import annotations

import csv
from pathlib import Path

from minivllm.bench.compare import DECAY_POINTS, SystemRun, SystemSummary, batch_size
from minivllm.bench.metrics import Distribution, ServingMetrics
from minivllm.tracing.trace import COLUMNS, StepRow


def serving_text(m: ServingMetrics) -> str:
    """The result block of `vllm bench serve`, with the same names and units."""
    lines = [f"{' Serving Benchmark Result ':=^60}",
             f"{'Successful requests:':<44}{m.completed:<16}",
             f"{'Failed requests:':<44}{m.failed:<16}",
             f"{'Benchmark duration (s):':<44}{m.duration:<16.2f}",
             f"{'Total input tokens:':<44}{m.total_input:<16}",
             f"{'Total generated tokens:':<44}{m.total_output:<16}",
             f"{'Request throughput (req/s):':<44}{m.request_throughput:<16.2f}"]
    if m.request_goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<44}{m.request_goodput:<16.2f}")
    lines += [f"{'Output token throughput (tok/s):':<44}{m.output_throughput:<16.2f}",
              f"{'Total token throughput (tok/s):':<44}{m.total_token_throughput:<16.2f}"]
    for label, short, dist in (("Time to First Token", "TTFT", m.ttft_ms),
                               ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
                               ("Inter-token Latency", "ITL", m.itl_ms), ("End-to-end Latency", "E2EL", m.e2el_ms)):
        lines += [f"{label:-^60}", f"{'Mean ' + short + ' (ms):':<44}{dist.mean:<16.2f}",
                  f"{'Median ' + short + ' (ms):':<44}{dist.median:<16.2f}"]
        lines += [f"{f'P{p:g} {short} (ms):':<44}{v:<16.2f}" for p, v in dist.percentiles.items() if p != 50]
    lines.append("=" * 60)
    return "\n".join(lines)


# -- bench compare -----------------------------------------------------------------------------------
def _pcts(d: Distribution) -> str:
    return " / ".join(f"{d.p(p):.0f}" for p in (50, 90, 99))


def _mean_p99(d: Distribution) -> str:
    return f"{d.mean:.0f} / {d.p(99):.0f}"


def compare_table(summaries: list[SystemSummary]) -> str:
    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(s) for s in summaries) + " |"

    def decay(s: SystemSummary) -> str:
        return " → ".join(f"{x:.0%}" for x in s.batch_decay) if s.batch_decay else "n/a (no fixed batch)"

    points = "/".join(f"{p:.0%}" for p in DECAY_POINTS)
    return "\n".join([
        "| | " + " | ".join(s.name for s in summaries) + " |",
        "|---|" + "---:|" * len(summaries),
        row("Throughput (requests/s)", lambda s: f"{s.serving.request_throughput:.3f}"),
        row("Output throughput (tokens/s)", lambda s: f"{s.serving.output_throughput:.1f}"),
        row("Total throughput (tokens/s)", lambda s: f"{s.serving.total_token_throughput:.1f}"),
        row("Duration, first arrival to last token (s)", lambda s: f"{s.serving.duration:.1f}"),
        row("TTFT P50 / P90 / P99 (ms)", lambda s: _pcts(s.serving.ttft_ms)),
        row("TPOT P50 / P90 / P99 (ms)", lambda s: _pcts(s.serving.tpot_ms)),
        row("E2E latency P50 / P90 / P99 (ms)", lambda s: _pcts(s.serving.e2el_ms)),
        row("**1. Padding waste** (share of computed tokens that were padding or idle slots)",
            lambda s: f"{s.padding_waste:.1%}"),
        row("**2. Batch occupancy**: mean sequences per step (time-weighted)", lambda s: f"{s.mean_batch:.1f}"),
        row("... live share of the slots computed in decode steps", lambda s: f"{s.slot_occupancy:.0%}"),
        row(f"... live share of a static batch at {points} of its steps", decay),
        row("**3. New requests kept waiting**: queue wait mean / P99 (ms)", lambda s: _mean_p99(s.queue_ms)),
        row("**4. Head-of-line blocking**: TTFT of short requests right behind a long one, mean / P99 (ms)",
            lambda s: f"{_mean_p99(s.hol_ttft_ms)} (n={s.num_hol_requests})"),
        row("... TTFT of all short requests, mean / P99 (ms)", lambda s: _mean_p99(s.short_ttft_ms)),
        row("Engine steps", lambda s: str(s.num_steps)),
    ])


def verdict(summaries: list[SystemSummary]) -> str:
    by_name = {s.name: s for s in summaries}
    static, cont = by_name.get("static"), by_name.get("continuous")
    if not (static and cont):
        return ""
    speedup = cont.serving.total_token_throughput / static.serving.total_token_throughput
    ttft = static.serving.ttft_ms.p(99) / max(cont.serving.ttft_ms.p(99), 1e-9)
    return (f"Continuous batching: {speedup:.2f}x the total throughput of static batching, "
            f"P99 TTFT {ttft:.1f}x lower, padding waste {cont.padding_waste:.1%} vs {static.padding_waste:.1%}.")


DEFINITIONS = """\
Definitions. Latencies count from a request's scheduled arrival (so queueing is included) and are
computed as `vllm bench serve` computes them: TPOT = (E2E - TTFT) / (output tokens - 1).
Throughput divides by the time from the first arrival to the last token. Padding waste: tokens the
model computed for nothing (static batching's prompt padding, and the slots of finished members that
keep computing until their batch ends) over all tokens computed. Sequences per step: sequences that
computed in the step. Short requests "right behind a long one": those whose previous arrival was a
long request (picked from the trace, the same requests for every system). Queue wait: arrival to
first scheduling. Hugging Face (`hf`): `generate` on static batches of the requests that have
arrived, left-padded; a member's tokens are timed as if streamed, and it ends at its last token.
"""


def compare_markdown(summaries: list[SystemSummary], workload: str, setup: str, command: str,
                     files: list[str]) -> str:
    return "\n\n".join([
        "# Static vs continuous batching on one arrival trace", f"Workload: {workload}", f"Setup: {setup}",
        f"Command: `{command}`", verdict(summaries), compare_table(summaries), DEFINITIONS,
        "![Batch occupancy over time](occupancy.png)", "![TTFT CDF](ttft_cdf.png)",
        "![Tokens per step](tokens_per_step.png)",
        "Files: " + ", ".join(f"`{f}`" for f in files) + "."]) + "\n"


def write_plots(runs: list[SystemRun], out_dir: Path, static_batch_size: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    def save(fig, name: str) -> str:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        return name

    names = []
    fig, ax = plt.subplots(figsize=(10, 4))
    for run in runs:
        ax.step([r.t_end for r in run.rows], [batch_size(r) for r in run.rows], where="pre", label=run.name)
    ax.axhline(static_batch_size, color="gray", ls="--", lw=0.8, label=f"static batch size ({static_batch_size})")
    ax.set(xlabel="time since the first arrival (s)", ylabel="sequences in the step",
           title="Batch occupancy over time")
    ax.legend()
    names.append(save(fig, "occupancy.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ttfts = sorted(m.ttft for m in run.metrics)
        ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=run.name)
    ax.set(xlabel="TTFT (s)", ylabel="share of requests", title="TTFT CDF")
    ax.legend()
    names.append(save(fig, "ttft_cdf.png"))

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), squeeze=False)
    top = max(r.num_scheduled_tokens for run in runs for r in run.rows) * 1.5
    for ax, run in zip(axes[:, 0], runs):
        steps = range(1, len(run.rows) + 1)
        useful = [r.num_scheduled_tokens - r.num_padding_tokens for r in run.rows]
        ax.bar(steps, useful, width=1.0, label="useful tokens")
        ax.bar(steps, [r.num_padding_tokens for r in run.rows], width=1.0, bottom=useful, color="tab:red",
               label="padding / idle slots")
        # Log scale: a prefill step computes hundreds of tokens, a decode step one per sequence.
        ax.set(yscale="log", ylim=(0.5, top), ylabel="tokens per step", title=run.name)
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("engine step")
    names.append(save(fig, "tokens_per_step.png"))
    return names



def write_rows(path: Path, rows: list[StepRow]) -> str:
    """Step rows in the engine's trace CSV format (the HF peer has no engine to write them)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows([getattr(r, c) for c in COLUMNS] for r in rows)
    return path.name
