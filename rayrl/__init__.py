"""rayrl: reinforcement learning for LLM agents.

The library is plain Python and torch; it never imports ray. Ray actors that wrap these classes live in
the top-level ``actors`` package, so every piece here can be used and tested on its own.
"""

__version__ = "0.1.0"
