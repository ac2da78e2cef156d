"""OpenAI/Anthropic-compatible gateway that records every LLM call token for token.

Import from the submodules: ``rayrl.gateway.app.Gateway``, ``rayrl.gateway.sessions.SessionInfo``.
"""
