"""How the policy is optimised: trainer backends (torch; megatron on GPU) and their table (backend.py), the
learning-rate schedule, LoRA and memory saving. What they optimise, the objective and the policy losses, is
the RL logic's (rayrl/rl/objective.py, rayrl/rl/policy_losses.py): both backends call the same
``Objective.loss``. Import the modules themselves: this package face imports none of them."""
