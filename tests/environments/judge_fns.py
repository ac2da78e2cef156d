"""Judge functions as users write them (rollout.judge.function)."""


def out_of_ten(task, result, judge) -> float:
    reply = judge.ask([{"role": "user", "content": f"Rate {result.final_answer!r} out of 10."}])
    return int(reply.split("/")[0]) / 10


def two_arguments(task, result) -> float:
    return 0.0


def by_reply_length(task, result, judge) -> float:
    """A verdict any reply gives (a random model's too): 1 for an odd number of characters, else 0."""
    return float(len(judge.ask([{"role": "user", "content": f"Is {result.final_answer!r} right?"}])) % 2)


def asks_then_grades_by_answer_length(task, result, judge) -> float:
    """Asks the judge (its reply read only for being there), then grades by the answer's length: rewards that
    differ within a group, so a run of a random policy trains."""
    judge.ask([{"role": "user", "content": f"Is {result.final_answer!r} right?"}])
    return float(len(result.final_answer or "") % 2)
