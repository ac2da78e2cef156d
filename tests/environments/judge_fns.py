"""Judge functions as users write them (rollout.judge.function)."""


def out_of_ten(task, result, judge) -> float:
    reply = judge.ask([{"role": "user", "content": f"Rate {result.final_answer!r} out of 10."}])
    return int(reply.split("/")[0]) / 10


def two_arguments(task, result) -> float:
    return 0.0
