"""Mutation check of the RL formulas: plant single-line errors one at a time, require the tests to fail.

    python scripts/mutate_formulas.py            # every plant (about 3 minutes on 2 cores: one pytest each)
    python scripts/mutate_formulas.py -k gspo    # the plants whose name contains "gspo"
    python scripts/mutate_formulas.py --list     # the plants, without running anything
    python scripts/mutate_formulas.py --skip 58  # all but the first 58 (a run cut short goes on)

Why: a formula test that asserts hand-computed values can still pass with a wrong formula (a clamp that
the example never reaches, a term the example sets to zero, a default the test passes explicitly). Each
:data:`PLANTS` entry names one module line and a wrong version of it; the script copies the working tree
(tracked and untracked, not ignored files) to a temporary directory once, checks that the formula tests
pass there unchanged, then for each plant edits the copy, runs the formula tests (``pytest -x``) with the
copy first on ``sys.path``, and restores the line. A plant the tests do not catch is a survivor: the
script lists survivors and exits 1. Every plant must change its file (a plant whose line is gone is an
error, so the list cannot rot silently). tests/test_mutate_formulas.py runs it in the slow suite;
docs/algorithms.md says when to add a plant (with every new formula).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMULA_TESTS = ("tests/test_advantages.py", "tests/test_policy_losses.py", "tests/test_objective.py",
                 "tests/test_formula_pins.py", "tests/test_rl_groups.py", "tests/test_guards.py")
ADV, LOSS, OBJ = "rayrl/rl/advantages.py", "rayrl/trainers/policy_losses.py", "rayrl/trainers/objective.py"
RES, LR, SHAPE, UPD = ("rayrl/config/resolve.py", "rayrl/trainers/lr_schedule.py", "rayrl/rl/shaping.py",
                       "rayrl/rl/updates.py")
GROUPS, GUARDS = "rayrl/rl/groups.py", "rayrl/rl/guards.py"


@dataclass(frozen=True)
class Plant:
    """Replace ``old`` (a substring of exactly one line of ``path``) with ``new``."""

    name: str
    path: str
    old: str
    new: str


PLANTS: tuple[Plant, ...] = (
    # advantage estimators
    Plant("grpo-std-sample-always", ADV, 'ddof = 1 if x.options.grpo_std == "sample" else 0', "ddof = 1"),
    Plant("grpo-std-population-always", ADV, 'ddof = 1 if x.options.grpo_std == "sample" else 0', "ddof = 0"),
    Plant("grpo-eps-inside-sqrt", ADV, "diff / (r.std(ddof=ddof) + EPS)",
          "diff / np.sqrt(r.var(ddof=ddof) + EPS)"),
    Plant("grpo-no-eps", ADV, "diff / (r.std(ddof=ddof) + EPS)", "diff / r.std(ddof=ddof)"),
    Plant("grpo-no-exact-zero", ADV, "out[idx] = 0.0 if not diff.any() else diff / (r.std(ddof=ddof) + EPS)",
          "out[idx] = (r - r.mean()) / (r.std(ddof=ddof) + EPS)"),
    Plant("grpo-singleton-raw", ADV, "out[idx] = _singleton(x, idx) / (1.0 + EPS)",
          "out[idx] = x.rewards[idx] / (1.0 + EPS)"),
    Plant("centred-no-tolerance", ADV, "return np.where(np.abs(diff) <= REWARD_TOLERANCE, 0.0, diff)",
          "return diff"),
    Plant("tolerance-looser", ADV, "REWARD_TOLERANCE = 1e-9", "REWARD_TOLERANCE = 1e-3"),
    Plant("eps-larger", ADV, "EPS = 1e-6", "EPS = 1e-4"),
    Plant("singleton-option-ignored", ADV,
          'return x.rewards[idx] if x.options.singleton_groups == "reward" else np.zeros(len(idx))',
          "return np.zeros(len(idx))"),
    Plant("dr-grpo-divides-by-std", ADV, "return _group_centred(x).astype(np.float32)",
          "return grpo(x)"),
    Plant("rloo-includes-self", ADV, "centred(r, (r.sum() - r) / (k - 1))", "centred(r, r.mean())"),
    Plant("rloo-divides-by-k", ADV, "centred(r, (r.sum() - r) / (k - 1))", "centred(r, (r.sum() - r) / k)"),
    Plant("rpp-unweighted-mean", ADV, "diff = centred(x.rewards, float((w * x.rewards).sum() / w.sum()))",
          "diff = centred(x.rewards, float(x.rewards.mean()))"),
    Plant("rpp-unweighted-std", ADV, "std = float(np.sqrt((w * diff ** 2).sum() / w.sum()))",
          "std = float(np.sqrt((diff ** 2).mean()))"),
    Plant("rpp-no-exact-zero", ADV, "diff = centred(x.rewards, float((w * x.rewards).sum() / w.sum()))",
          "diff = x.rewards - float((w * x.rewards).sum() / w.sum())"),
    Plant("rppb-not-recentred", ADV, "shifted = values - mean", "shifted = values"),
    Plant("rppb-unweighted", ADV, "mean = float((w * values).sum() / w.sum())", "mean = float(values.mean())"),
    Plant("rppb-unweighted-std", ADV, "std = float(np.sqrt((w * shifted ** 2).sum() / w.sum()))",
          "std = float(np.sqrt((shifted ** 2).mean()))"),
    Plant("rppb-eps-inside-sqrt", ADV, "return np.where(values == 0.0, 0.0, shifted / (std + EPS))",
          "return np.where(values == 0.0, 0.0, shifted / np.sqrt(std ** 2 + EPS))"),
    Plant("rppb-zeros-not-kept", ADV, "return np.where(values == 0.0, 0.0, shifted / (std + EPS))",
          "return shifted / (std + EPS)"),
    Plant("rppb-no-group-baseline", ADV, "return _whiten(_group_centred(x), x.token_counts).astype(np.float32)",
          "return _whiten(x.rewards, x.token_counts).astype(np.float32)"),
    # policy losses
    Plant("ppo-no-log-ratio-clamp", LOSS,
          "ratio = torch.exp(torch.clamp(x.logp - x.old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO))\n    return",
          "ratio = torch.exp(x.logp - x.old_logp)\n    return"),
    Plant("max-log-ratio-larger", LOSS, "MAX_LOG_RATIO = 20.0", "MAX_LOG_RATIO = 30.0"),
    Plant("ppo-min-not-max", LOSS, "loss = torch.maximum(unclipped, clipped)",
          "loss = torch.minimum(unclipped, clipped)"),
    Plant("ppo-symmetric-clip", LOSS, "torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_high)\n    loss",
          "torch.clamp(ratio, 1.0 - x.clip_low, 1.0 + x.clip_low)\n    loss"),
    Plant("dual-clip-positive-advantages", LOSS,
          "loss = torch.where(adv < 0, torch.minimum(loss, -adv * x.dual_clip_c), loss)",
          "loss = torch.minimum(loss, -adv * x.dual_clip_c)"),
    Plant("dual-clip-without-c", LOSS,
          "loss = torch.where(adv < 0, torch.minimum(loss, -adv * x.dual_clip_c), loss)",
          "loss = torch.where(adv < 0, torch.minimum(loss, -adv), loss)"),
    Plant("clip-flag-inverted", LOSS, "(loss.detach() != unclipped.detach())", "(loss.detach() == unclipped.detach())"),
    Plant("gspo-token-ratio", LOSS, "seq_log_ratio = (sums / counts.clamp(min=1.0))[x.seq_index]",
          "seq_log_ratio = log_ratio"),
    Plant("gspo-sum-not-mean", LOSS, "seq_log_ratio = (sums / counts.clamp(min=1.0))[x.seq_index]",
          "seq_log_ratio = sums[x.seq_index]"),
    Plant("gspo-no-clamp", LOSS, "torch.clamp(x.logp - x.logp.detach() + seq_log_ratio, max=MAX_SEQ_LOG_RATIO)",
          "x.logp - x.logp.detach() + seq_log_ratio"),
    Plant("gspo-ratio-no-gradient", LOSS, "x.logp - x.logp.detach() + seq_log_ratio, max",
          "(x.logp - x.logp).detach() + seq_log_ratio, max"),
    Plant("cispo-gradient-through-weight", LOSS,
          "ratio = torch.exp(torch.clamp(x.logp - x.old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()",
          "ratio = torch.exp(torch.clamp(x.logp - x.old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO))"),
    Plant("cispo-no-log-ratio-clamp", LOSS,
          "ratio = torch.exp(torch.clamp(x.logp - x.old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()",
          "ratio = torch.exp(x.logp - x.old_logp).detach()"),
    Plant("k3-sign", LOSS, "log_r = torch.clamp(-diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)",
          "log_r = torch.clamp(diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)"),
    Plant("k3-no-value-clamp", LOSS, "return torch.clamp(torch.exp(log_r) - log_r - 1.0, max=10.0)",
          "return torch.exp(log_r) - log_r - 1.0"),
    Plant("k2-no-half", LOSS, "return 0.5 * diff.square()", "return diff.square()"),
    # the loss helper
    Plant("kl-reward-gradient", OBJ, 'adv = adv - algo.kl_reward_coef * kl_estimate(proximal, self._ref(tb), "k1")',
          'adv = adv - algo.kl_reward_coef * kl_estimate(logp, self._ref(tb), "k1")'),
    Plant("kl-reward-sign", OBJ, 'adv = adv - algo.kl_reward_coef * kl_estimate(proximal, self._ref(tb), "k1")',
          'adv = adv + algo.kl_reward_coef * kl_estimate(proximal, self._ref(tb), "k1")'),
    Plant("kl-loss-tis-weighted", OBJ, "per_token = per_token + algo.kl_loss_coef * kl",
          "per_token = per_token + algo.kl_loss_coef * kl * tis"),
    Plant("tis-against-proximal-reversed", OBJ,
          "tis = torch.clamp(torch.exp(torch.clamp(proximal - tb.rollout_logp, max=20.0)), max=self.tis_cap)",
          "tis = torch.clamp(torch.exp(torch.clamp(tb.rollout_logp - proximal, max=20.0)), max=self.tis_cap)"),
    Plant("tis-not-capped", OBJ,
          "tis = torch.clamp(torch.exp(torch.clamp(proximal - tb.rollout_logp, max=20.0)), max=self.tis_cap)",
          "tis = torch.exp(torch.clamp(proximal - tb.rollout_logp, max=20.0))"),
    Plant("sft-loss-tis-weighted", OBJ, "if self.tis_cap > 0 and algo.policy_loss not in UNWEIGHTED_LOSSES:",
          "if self.tis_cap > 0:"),
    Plant("ratio-always-rollout", OBJ, "old = proximal if self.tis_cap > 0 else tb.rollout_logp",
          "old = tb.rollout_logp"),
    Plant("entropy-sign", OBJ, "per_token = per_token - algo.entropy_coef * entropy",
          "per_token = per_token + algo.entropy_coef * entropy"),
    Plant("sft-term-unmasked", OBJ, "per_token = per_token - algo.sft_coef * tb.sft * logp",
          "per_token = per_token - algo.sft_coef * logp"),
    Plant("seq-mean-token-mean-no-length", OBJ, "return 1.0 / (max(trained_tokens, 1) * mb.sequences)",
          "return 1.0 / mb.sequences"),
    Plant("dr-grpo-norm-not-constant", OBJ, "return 1.0 / (self.algo.loss_agg_norm * mb.sequences)",
          "return 1.0 / (trained_tokens * mb.sequences)"),
    Plant("token-mean-per-sequence", OBJ, "return 1.0 / mb.tokens\n", "return 1.0 / (mb.tokens * mb.sequences)\n"),
    # defaults
    Plant("loss-agg-auto-gspo", RES, 'if algo.policy_loss == "gspo":\n        return "seq_mean_token_mean"',
          'if algo.policy_loss == "gspo":\n        return "token_mean"'),
    Plant("loss-agg-auto-dr-grpo", RES, 'return "seq_mean_token_sum_norm"', 'return "seq_mean_token_sum"'),
    Plant("loss-agg-auto-order", RES, 'if algo.policy_loss == "gspo":\n        return "seq_mean_token_mean"',
          'if algo.policy_loss == "gspo" and algo.advantage_estimator != "dr_grpo":\n'
          '        return "seq_mean_token_mean"'),
    Plant("gspo-band", RES, '"gspo": (3e-4, 4e-4)', '"gspo": (3e-3, 4e-3)'),
    Plant("cispo-band", RES, '"cispo": (1.0, 4.0)', '"cispo": (0.2, 4.0)'),
    Plant("ppo-band", RES, '"ppo_clip": (0.2, 0.28)', '"ppo_clip": (0.2, 0.2)'),
    Plant("dr-grpo-constant", RES, "loss_agg_norm=algo.loss_agg_norm or cfg.rollout.max_turns * cfg.rollout.max_tokens",
          "loss_agg_norm=algo.loss_agg_norm or cfg.rollout.max_tokens"),
    Plant("dynamic-sampling-bound", RES, "DYNAMIC_SAMPLING_DRAWS * cfg.rollout.prompts_per_step",
          "2 * cfg.rollout.prompts_per_step"),
    Plant("tis-default-sync-on", RES, 'on = schedule != "sync" or algo.policy_loss in NARROW_BAND_LOSSES',
          "on = True"),
    Plant("tis-default-gspo-off", RES, 'on = schedule != "sync" or algo.policy_loss in NARROW_BAND_LOSSES',
          'on = schedule != "sync"'),
    Plant("lr-total-no-epochs", LR, "return cfg.steps * cfg.num_steps_per_rollout * cfg.epochs_per_rollout",
          "return cfg.steps * cfg.num_steps_per_rollout"),
    Plant("lr-cosine-span", LR, "span = max(total_optimizer_steps(cfg) - cfg.lr_warmup_steps - 1, 1)",
          "span = max(total_optimizer_steps(cfg) - cfg.lr_warmup_steps, 1)"),
    Plant("lr-warmup-from-zero", LR, "return cfg.lr * (step + 1) / cfg.lr_warmup_steps",
          "return cfg.lr * step / cfg.lr_warmup_steps"),
    Plant("lr-no-floor", LR, "return cfg.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))",
          "return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))"),
    # shaping, sample selection, groups
    Plant("overlong-linear-sign", SHAPE, "return scale * (max_tokens - buffer_tokens - length) / buffer_tokens",
          "return scale * (length - max_tokens + buffer_tokens) / buffer_tokens"),
    Plant("overlong-past-limit", SHAPE, "if length > max_tokens:\n        return -scale",
          "if length > max_tokens:\n        return -1.0"),
    Plant("zero-advantage-trains", UPD, "return bool(np.any(np.asarray(advantage) != 0))", "return True"),
    Plant("sft-threshold-strict", UPD, "return algo.sft_min_reward is None or sample.reward >= algo.sft_min_reward",
          "return algo.sft_min_reward is None or sample.reward > algo.sft_min_reward"),
    Plant("equal-reward-own-tolerance", GROUPS, "def equal_reward(group: Group, tolerance: float = REWARD_TOLERANCE)",
          "def equal_reward(group: Group, tolerance: float = 1e-9)"),
    # guards
    Plant("guard-below-above", GUARDS, "return figure.value > threshold if self.above else figure.value < threshold",
          "return figure.value >= threshold if self.above else figure.value < threshold"),
    Plant("guard-min-count", GUARDS, "if figure.count < self.min_count:", "if figure.count < 1:"),
    Plant("guard-no-patience", GUARDS, "if not past or self.streaks[guard.name] < guard.patience:", "if not past:"),
    Plant("guard-streak-not-reset", GUARDS,
          "self.streaks[guard.name] = self.streaks[guard.name] + 1 if past else 0",
          "self.streaks[guard.name] = self.streaks[guard.name] + 1"),
    Plant("guard-cut-any-last-turn", GUARDS,
          'return max_turns > 0 and _count(facts, "turns") >= max_turns and facts.get("last_finish") == "tool_calls"',
          'return max_turns > 0 and _count(facts, "turns") >= max_turns'),
    Plant("guard-parse-rate-denominator", GUARDS, 'attempts += n + _count(f, "tool_calls")',
          'attempts += _count(f, "tool_calls") or 1'),
    Plant("guard-zero-variance-infra", GUARDS, "        if is_scored(e):\n            by_group",
          "        if True:\n            by_group"),
)


def working_tree_files(root: Path) -> list[str]:
    """Tracked and untracked files that git does not ignore."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    return [p for p in out.split("\0") if p and (root / p).is_file()]


def copy_tree(root: Path, dest: Path) -> None:
    for rel in working_tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def run_tests(copy: Path, tests: tuple[str, ...]) -> tuple[bool, float]:
    """(passed, seconds) of the formula tests in ``copy`` (which comes first on sys.path)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-m", "not slow", *tests], cwd=copy, env=env, capture_output=True, text=True)
    return proc.returncode == 0, time.monotonic() - started


def apply(copy: Path, plant: Plant) -> str:
    """Plant it; returns the original text of the file."""
    path = copy / plant.path
    text = path.read_text()
    if text.count(plant.old) != 1:
        raise SystemExit(f"plant {plant.name}: {plant.old!r} occurs {text.count(plant.old)} times in {plant.path} "
                         "(it must occur once: update the plant with the code)")
    path.write_text(text.replace(plant.old, plant.new))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the plants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the plants and exit")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N plants (to finish a cut run)")
    args = parser.parse_args(argv)
    plants = [p for p in PLANTS[args.skip:] if args.k in p.name]
    if args.list:
        for p in plants:
            print(f"{p.name:36s} {p.path}")
        print(f"{len(plants)} plants")
        return 0
    with tempfile.TemporaryDirectory(prefix="rayrl-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(ROOT, copy)
        where = subprocess.run([sys.executable, "-c", "import rayrl; print(rayrl.__file__)"], cwd=copy,
                               env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True).stdout
        if not where.startswith(str(copy)):
            raise SystemExit(f"the copy's rayrl is not the one imported ({where.strip()}): the check would test "
                             "the wrong code")
        ok, seconds = run_tests(copy, FORMULA_TESTS)
        if not ok:
            raise SystemExit("the formula tests fail on the unchanged copy: fix them first")
        print(f"baseline: the formula tests pass ({seconds:.1f} s); {len(plants)} plants", flush=True)
        survivors = []
        for i, plant in enumerate(plants, 1):
            original = apply(copy, plant)
            try:
                passed, seconds = run_tests(copy, FORMULA_TESTS)
            finally:
                (copy / plant.path).write_text(original)
            verdict = "SURVIVED" if passed else "caught"
            print(f"[{i}/{len(plants)}] {plant.name}: {verdict} ({seconds:.1f} s)", flush=True)
            if passed:
                survivors.append(plant.name)
    caught = len(plants) - len(survivors)
    print(f"{caught} of {len(plants)} plants caught" + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
