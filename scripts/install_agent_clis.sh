#!/usr/bin/env bash
# Install the agent CLIs that rayrl's harnesses drive (Claude Code, Codex) into one npm prefix.
#
#   bash scripts/install_agent_clis.sh            # -> .cache/agent-clis under the repository
#   RAYRL_AGENT_CLIS_DIR=/opt/agent-clis bash scripts/install_agent_clis.sh
#
# Idempotent: when both binaries are already there at the pinned versions nothing is downloaded.
# Versions are pinned to the ones whose wire behaviour docs/gateway.md describes; override with
# RAYRL_CLAUDE_CODE_VERSION / RAYRL_CODEX_VERSION. Prints the bin directory on its last line.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${RAYRL_AGENT_CLIS_DIR:-$here/.cache/agent-clis}"
claude_version="${RAYRL_CLAUDE_CODE_VERSION:-2.1.197}"
codex_version="${RAYRL_CODEX_VERSION:-0.169.0}"
stamp="$prefix/.installed-claude-$claude_version-codex-$codex_version"

if ! command -v npm >/dev/null 2>&1; then
    echo "install_agent_clis: npm is not installed (Node.js >= 18 is required)" >&2
    exit 2
fi

if [[ -f "$stamp" && -x "$prefix/node_modules/.bin/claude" && -x "$prefix/node_modules/.bin/codex" ]]; then
    echo "$prefix/node_modules/.bin"
    exit 0
fi

mkdir -p "$prefix"
# --prefix without -g installs into $prefix/node_modules (bin links in node_modules/.bin).
# Claude Code's postinstall only fetches an optional native helper; its bin/claude.exe is complete.
npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@$claude_version" "@openai/codex@$codex_version" >&2
"$prefix/node_modules/.bin/claude" --version >&2
"$prefix/node_modules/.bin/codex" --version >&2
rm -f "$prefix"/.installed-*
touch "$stamp"
echo "$prefix/node_modules/.bin"
