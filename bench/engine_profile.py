"""Where the CPU engine's time goes, for bench/engine_vs_llamacpp.py: its ops by kind of work, and the
tables and notes that go beside the comparison (both sides' prefill/decode split; ours under torch's
profiler; for each missed goal, what the profile says).

Kept apart from the comparison because it is one concern: reading a torch profile.
"""

from __future__ import annotations

from typing import Any

from measure import Record

SIDES = ("ours", "llama.cpp")

OP_KINDS = (  # (kind, substrings of torch op names), first match wins
    ("matmuls with weights", ("linear_dynamic", "addmm", "aten::mm", "aten::linear", "matmul")),
    ("attention", ("scaled_dot_product", "flash_attention", "aten::bmm", "baddbmm")),
    ("sampling and log-softmax", ("log_softmax", "argmax", "gather", "amax", "isfinite", "searchsorted")),
)


def op_kind(name: str) -> str:
    for kind, keys in OP_KINDS:
        if any(k in name for k in keys):
            return kind
    return "other ops (norms, RoPE, residuals, cache writes, copies)"


def report_profile(record: Record, info: dict[str, Any], results: dict[str, dict], profiles: dict[str, dict],
                   new: int, goals: dict[str, bool], weight_bytes: dict[str, int]) -> None:
    """Where the time goes: both sides' prefill and decode, then ours by kind of work; a note per missed goal."""
    rows = []
    for name in profiles:
        for side in SIDES:
            prefill, step = results[name][side]["prefill_s"], results[name][side]["decode_ms_step"]
            share = prefill.median / (prefill.median + step.median * (new - 1) / 1e3)
            rows.append([name, side, prefill.fmt(3), step.fmt(1), f"{share:.0%}"])
    record.table("prefill and decode per side, from the same alternating rounds: prefill = until every request has "
                 "its first token; decode = the rest, per step (every running sequence gets one token)",
                 ["row", "engine", "prefill s", "decode ms/step", "prefill share"], rows)
    kinds = sorted({k for prof in profiles.values() for k in prof["kinds"]})
    rows = []
    for name, prof in profiles.items():
        wall = prof["wall"]
        inside = sum(prof["kinds"].values())
        step_ms = 1e3 * prof["decode_s"] / max(prof["steps"], 1)
        rows.append([name, f"{wall:.2f}", f"{prof['prefill_s']:.2f}", f"{step_ms:.1f}",
                     *(f"{prof['kinds'].get(k, 0.0) / wall:.0%}" for k in kinds),
                     f"{max(wall - inside, 0.0) / wall:.0%}"])
    record.table("ours under torch's profiler, one run per row after the rounds (the profiler slows it a little): "
                 "self time of the ops by kind as a share of the run's wall time, and the time outside any op "
                 "(Python, dispatch, waits)",
                 ["row", "wall s", "prefill s", "decode ms/step", *kinds, "outside ops"], rows)
    record.figure("profile", profiles)
    ours_mib, llama_mib = weight_bytes["ours"] / 2**20, weight_bytes["llama.cpp"] / 2**20
    for name, prof in profiles.items():
        if goals.get(name, True):
            continue
        share = {k: v / prof["wall"] for k, v in prof["kinds"].items()}
        top = sorted(share.items(), key=lambda kv: -kv[1])
        ours, llama = results[name]["ours"], results[name]["llama.cpp"]
        record.note(
            f"{name}: goal missed. Ours: prefill {ours['prefill_s'].median:.2f} s and "
            f"{ours['decode_ms_step'].median:.1f} "
            f"ms per decode step against llama.cpp's {llama['prefill_s'].median:.2f} s and "
            f"{llama['decode_ms_step'].median:.1f} ms; under the profiler, "
            + ", ".join(f"{kind} {v:.0%}" for kind, v in top)
            + f", outside ops {max(prof['wall'] - sum(prof['kinds'].values()), 0.0) / prof['wall']:.0%} of the run. "
            f"A decode step reads {ours_mib:.0f} MiB of weights ({info['ours']['weight_format']}) against "
            f"llama.cpp's {llama_mib:.0f} MiB (4-bit).")
