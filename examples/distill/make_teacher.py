"""Make a teacher for on-policy distillation on the files task: SmolLM2-135M-Instruct fine-tuned (SFT)
on worked solutions, saved as a model directory an engine serves.

    python examples/distill/make_teacher.py --out runs/files-teacher      # ~15 min on 2 CPU cores

The solutions are written from each training task's own files, the way the task is meant to be solved
(examples/files/README.md): list the folder, or search for the word, then read the file(s), then answer.
They are rendered exactly as the gateway renders the python agent's conversation for the student
(the same system prompt, worked examples, tool-call text and chat template), one sample per assistant
turn with only that turn trained, and the model is trained on them with rayrl's own trainer and its
``sft`` loss (algorithm.policy_loss: sft). The result is a genuinely different model that is better at
the task than the student it teaches (docs/results/algorithms.md measures both).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from rayrl.agents.python_agent import PythonToolAgent
from rayrl.agents.toolbox import make_tools
from rayrl.config import AlgorithmConfig, TrainerConfig, load_config
from rayrl.gateway.parsers import get_tool_parser
from rayrl.gateway.render import ChatRenderer
from rayrl.models import resolve_model_path
from rayrl.rl.updates import plan_updates
from rayrl.trainers.torch_backend import TorchTrainer
from rayrl.types import Sample

ROOT = Path(__file__).resolve().parents[2]


def solution(meta: dict[str, Any]) -> tuple[list[tuple[str, dict, str]], str]:
    """The tool calls (name, arguments, output as the tool prints it) and the final answer for one task."""
    files: dict[str, str] = meta["files"]
    folder = next(iter(files)).split("/")[0]
    listing = "\n".join(sorted(p.split("/", 1)[1] for p in files))
    question = meta["question"]
    if meta["level"] == 2:
        word = question.split(" says it is ")[1].split(".")[0]
        hit = next(p for p, text in sorted(files.items()) if word in text)
        return [("search", {"text": word, "path": folder}, hit),
                ("read_file", {"path": hit}, files[hit].strip())], f"The answer is {meta['answer']}."
    names = [n for n in question.replace("?", "").split() if any(p.split("/")[1].startswith(n + "_") for p in files)]
    steps = [("list_dir", {"path": folder}, listing)]
    values = []
    for name in names:
        path = next(p for p in files if p.split("/")[1].startswith(name + "_"))
        steps.append(("read_file", {"path": path}, files[path].strip()))
        values.append(int(files[path].split(":")[1].split()[0]))
    if meta["level"] == 3:
        return steps, f"{values[0]} + {values[1]} = {sum(values)}. The answer is {sum(values)}."
    return steps, f"The answer is {meta['answer']}."


def samples_for(task: dict[str, Any], renderer: ChatRenderer, prefix: list[dict[str, Any]]) -> list[Sample]:
    """One sample per assistant turn of the task's solution: the conversation so far as the prompt, that
    turn (its text and the end-of-turn marker) trained."""
    steps, answer = solution(task["metadata"])
    messages = [*prefix, {"role": "user", "content": task["metadata"]["question"]}]
    turns: list[dict[str, Any]] = []
    for i, (name, args, output) in enumerate(steps):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        turns.append({"role": "tool", "tool_call_id": f"call_{i}", "content": output})
    turns.append({"role": "assistant", "content": answer})
    out = []
    for k, msg in enumerate(turns):
        if msg["role"] != "assistant":
            continue
        history = messages + turns[:k]
        prompt = renderer.tokenize(renderer.render_text(history, None, add_generation_prompt=True))
        full = renderer.tokenize(renderer.render_text(history + [msg], None, add_generation_prompt=False))
        if not np.array_equal(full[: len(prompt)], prompt):
            raise RuntimeError("the rendered turn does not extend its prompt")
        n = len(full) - len(prompt)
        out.append(Sample(tokens=full, prompt_length=len(prompt), loss_mask=np.ones(n, np.int8),
                          rollout_logprobs=np.zeros(n, np.float32), policy_versions=np.zeros(n, np.int32),
                          reward=1.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/files-teacher")
    ap.add_argument("--tasks", type=int, default=160, help="training tasks whose solutions are trained")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = load_config(ROOT / "examples" / "files" / "config.yaml")
    model_dir = resolve_model_path(cfg.model.path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatRenderer(tokenizer, get_tool_parser(cfg.gateway.tool_parser),
                            inject_tool_schemas=cfg.gateway.inject_tool_schemas)
    agent = PythonToolAgent(cfg.rollout.tools, cfg.rollout.system_prompt, cfg.rollout.few_shot_examples)
    prefix = [{"role": "system", "content": agent.system_prompt},
              *agent.demonstrations(make_tools(cfg.rollout.tools))]
    rows = [json.loads(line) for line in (ROOT / cfg.data.train_path).read_text().splitlines()]
    rng = random.Random(args.seed)
    rng.shuffle(rows)
    samples = [s for row in rows[: args.tasks] for s in samples_for(row, renderer, prefix)]
    trained = sum(s.num_trained_tokens for s in samples)
    print(f"{len(samples)} samples from {args.tasks} tasks, {trained} trained tokens", flush=True)
    trainer_cfg = TrainerConfig(lr=args.lr, grad_clip=1.0, micro_batch_tokens=4096,
                                steps=args.epochs * -(-len(samples) // args.batch))
    trainer = TorchTrainer(model_dir, trainer_cfg, algorithm=AlgorithmConfig(policy_loss="sft"), seed=args.seed)
    started, step = time.monotonic(), 0
    for epoch in range(args.epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order), args.batch):
            chunk = [samples[i] for i in order[start : start + args.batch]]
            (keep, plan), = plan_updates(chunk, [1.0] * len(chunk), trainer.algorithm)
            m = trainer.train_step([chunk[i] for i in keep], [1.0] * len(keep), plan)
            step += 1
            print(f"epoch {epoch} step {step}: nll {m['loss']:.4f} grad_norm {m['grad_norm']:.2f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    out = Path(args.out)
    trainer.model.save_pretrained(out, safe_serialization=True)
    for f in model_dir.iterdir():  # tokenizer and chat template: the teacher must tokenize as the student does
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    print(f"teacher saved to {out}", flush=True)


if __name__ == "__main__":
    main()
