"""The run's orchestration, free of Ray: the schedules (how rollout and training share time), who owns
engine membership, and the checkpoints with the way back after a trainer failure. Each is typed against
the small protocols in parts.py; actors/ provides the Ray shells that satisfy them (actors/pipeline.py
wires them), and tests/orchestration/test_schedule_phases.py drives them with plain fakes."""
