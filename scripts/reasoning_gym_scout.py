"""How often the CPU model is exactly right on reasoning-gym tasks, before any training: which task has room.

A task is worth a training run when the model is sometimes right (GRPO learns only from groups whose samples
differ) and often wrong. For each task this samples rayrl's own CPU engine (what a run samples from) with
three worked examples of the task as earlier chat turns (from another seed of the same generator, in the
dataset's own phrasing) and scores each reply as ``rollout.reward: reasoning_gym`` does: reasoning-gym's
``extract_answer`` through ``rayrl.data.reasoning_gym.strict_answer`` (a reply without ``<answer>`` tags is
None) and the dataset's own ``score_answer``.
Per task it prints the exact rate, the tagged rate, how many questions had a mixed group, and the most
common true answer (what a model that always says it would score). docs/results/reasoning_gym.md.

    python scripts/reasoning_gym_scout.py --questions 16 --samples 4 letter_counting_5_10 aiw
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

from rayrl.models import resolve_model_path

SYSTEM = "Answer inside <answer></answer>, with nothing else."
TASKS: dict[str, tuple[str, dict[str, Any]]] = {  # scout name: (reasoning-gym dataset, its options)
    "letter_counting_3_5": ("letter_counting", {"min_words": 3, "max_words": 5}),
    "letter_counting_5_10": ("letter_counting", {"min_words": 5, "max_words": 10}),
    "aiw": ("aiw", {}),
    "family_relationships": ("family_relationships", {}),
    "basic_arithmetic_add": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                                  "operators": ["+"]}),
    "chain_sum_1_digit": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "leg_counting_1": ("leg_counting", {"min_animals": 1, "max_animals": 1}),
    "spell_backward_3": ("spell_backward", {"min_word_len": 3, "max_word_len": 3}),
    "gcd_small": ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20}),
    "isomorphic_strings": ("isomorphic_strings", {}),
    "syllogism": ("syllogism", {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tasks", nargs="*", help=f"scout names (default: all): {', '.join(TASKS)}")
    ap.add_argument("--questions", type=int, default=16, help="questions per task (generator seed 7)")
    ap.add_argument("--samples", type=int, default=4, help="samples per question")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model name rayrl provisions, or a path")
    args = ap.parse_args()
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")

    import reasoning_gym

    from rayrl.data.reasoning_gym import strict_answer
    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.sampling import SamplingParams

    started = time.monotonic()
    engine = CPUEngine(resolve_model_path(args.model), dtype="float32", max_batch_size=64,
                       weight_format="auto").start()
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature)
    submitted = {}
    for key in args.tasks or list(TASKS):  # every task's requests at once: the engine batches them
        name, options = TASKS[key]
        shots = reasoning_gym.create_dataset(name, size=3, seed=99, **options)
        messages = [{"role": "system", "content": SYSTEM}]
        for shot in shots:
            messages += [{"role": "user", "content": shot["question"]},
                         {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"}]
        entries = reasoning_gym.create_dataset(name, size=args.questions, seed=7, **options)
        submitted[key] = [(entry, [engine.submit(ids, params, return_logprob=False) for _ in range(args.samples)])
                          for entry in entries
                          for ids in [engine.tokenizer.apply_chat_template(
                              messages + [{"role": "user", "content": entry["question"]}], add_generation_prompt=True)]]
    try:
        for key, groups in submitted.items():
            score = reasoning_gym.get_score_answer_fn(TASKS[key][0])
            exact = tagged = mixed = 0
            for entry, handles in groups:
                answers = [strict_answer(h.result(600).text) for h in handles]  # as rollout.reward: reasoning_gym reads
                right = sum(score(a, entry) == 1.0 for a in answers)
                exact += right
                tagged += sum(a is not None for a in answers)
                mixed += 0 < right < len(answers)
            n = len(groups) * args.samples
            common, count = collections.Counter(str(e["answer"]) for e, _ in groups).most_common(1)[0]
            print(f"{key:22s} exact {exact}/{n} ({exact / n:.2f}) | tagged {tagged / n:.2f} | mixed groups "
                  f"{mixed}/{len(groups)} | commonest answer {common!r} ({count}/{len(groups)}) | "
                  f"{time.monotonic() - started:.0f} s", flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
