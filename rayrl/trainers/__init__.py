"""Trainer backends (torch; megatron on GPU) and their table (backend.py), the one loss helper they share
(objective.py), the policy losses and their table (policy_losses.py), the learning-rate schedule and memory
saving. Import the modules themselves: this package face imports none of them, so the RL logic
(rayrl/rl/updates.py reads the losses' traits) can import a loss table without the trainers."""
