"""File tools the python agent can call on its sandbox: list a directory, read a file, search file contents.

They serve tasks whose answer lives in the sandbox's files (examples/files, examples/swe): the model must
look before it can answer. Each runs a small helper script inside the sandbox, so paths resolve there and
the sandbox's own isolation bounds what a call can see; outputs are capped so a huge file cannot flood the
context. ``write_file`` edits a file (examples/swe: the agent fixes code through it).
"""

from __future__ import annotations

from typing import Any

from rayrl.agents.tools import Tool
from rayrl.sandboxes.base import Sandbox

MAX_OUTPUT_CHARS = 2000

FILES_SCRIPT = r'''
import os, sys
MAX = int(sys.argv[1]); op = sys.argv[2]; arg = sys.argv[3] if len(sys.argv) > 3 else "."
def fail(msg):
    print("error: " + msg); sys.exit(1)
def rel(path):
    return os.path.relpath(path, ".")
if op == "list":
    if not os.path.isdir(arg):
        fail(f"no such directory: {arg}")
    names = sorted(os.listdir(arg))
    out = [n + ("/" if os.path.isdir(os.path.join(arg, n)) else "") for n in names if not n.startswith(".")]
    print("\n".join(out) if out else "(empty)")
elif op == "read":
    if not os.path.isfile(arg):
        fail(f"no such file: {arg}")
    with open(arg, "r", errors="replace") as fh:
        text = fh.read(MAX + 1)
    print(text[:MAX] + ("\n... (truncated)" if len(text) > MAX else ""))
elif op == "search":
    pattern, root = arg, (sys.argv[4] if len(sys.argv) > 4 else ".")
    if not pattern:
        fail("pattern must not be empty")
    if not os.path.isdir(root):
        fail(f"no such directory: {root}")
    hits = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(base, name)
            try:
                with open(path, "r", errors="replace") as fh:
                    if pattern in fh.read(1 << 20):
                        hits.append(rel(path))
            except OSError:
                pass
    print("\n".join(hits) if hits else "no file contains " + repr(pattern))
else:
    fail("unknown operation")
'''


class _FileTool(Tool):
    script_path = ".files_tool.py"
    timeout_s = 10.0

    def setup(self, sandbox: Sandbox | None) -> None:
        if sandbox is None:
            raise RuntimeError(f"the {self.name} tool needs a sandbox")
        sandbox.write_file(self.script_path, FILES_SCRIPT.encode())

    def _run(self, sandbox: Sandbox | None, *args: str) -> tuple[str, bool]:
        assert sandbox is not None
        result = sandbox.exec(["python3", self.script_path, str(MAX_OUTPUT_CHARS), *args], timeout=self.timeout_s)
        if result.timed_out:
            return f"error: {self.name} timed out", False
        out = (result.stdout or result.stderr).strip()[:MAX_OUTPUT_CHARS + 100]
        return out, result.exit_code == 0

    @staticmethod
    def _path(arguments: dict[str, Any], key: str = "path", default: str | None = None) -> str | None:
        value = arguments.get(key, default)
        return value if isinstance(value, str) and value.strip() else None


class ListDirTool(_FileTool):
    name = "list_dir"
    description = "List the files and folders in a directory (folders end with /)"
    parameters = {"type": "object", "properties": {"path": {"type": "string", "description": "directory"}},
                  "required": ["path"]}
    demos = [
        ("What number is in the file for bean in the shelf folder?",
         [("list_dir", {"path": "shelf"}, "bean_q4.txt\ncorn_b2.txt\nrice_m7.txt"),
          ("read_file", {"path": "shelf/bean_q4.txt"}, "bean: 31")],
         "The answer is 31."),
        ("What is the sum of the numbers for oat and rye in the bin folder?",
         [("list_dir", {"path": "bin"}, "oat_c1.txt\nrye_k5.txt\nwheat_s3.txt"),
          ("read_file", {"path": "bin/oat_c1.txt"}, "oat: 12"),
          ("read_file", {"path": "bin/rye_k5.txt"}, "rye: 45")],
         "12 + 45 = 57. The answer is 57."),
    ]

    def call(self, sandbox: Sandbox | None, arguments: dict[str, Any]) -> tuple[str, bool]:
        path = self._path(arguments, default=".")
        if path is None:
            return "error: 'path' must be a non-empty string", False
        return self._run(sandbox, "list", path)


class ReadFileTool(_FileTool):
    name = "read_file"
    description = "Read a text file"
    parameters = {"type": "object", "properties": {"path": {"type": "string", "description": "file to read"}},
                  "required": ["path"]}

    def call(self, sandbox: Sandbox | None, arguments: dict[str, Any]) -> tuple[str, bool]:
        path = self._path(arguments)
        if path is None:
            return "error: 'path' must be a non-empty string", False
        return self._run(sandbox, "read", path)


class SearchTool(_FileTool):
    name = "search"
    description = "List the files under a directory whose text contains a string"
    demos = [
        ("One file in the crate folder says it is red. What number is in that file?",
         [("search", {"text": "red", "path": "crate"}, "crate/nut_t8.txt"),
          ("read_file", {"path": "crate/nut_t8.txt"}, "nut: 64\nthis one is red")],
         "The answer is 64."),
    ]
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "text to look for"},
                       "path": {"type": "string", "description": "directory to search (default: all)"}},
        "required": ["text"],
    }

    def call(self, sandbox: Sandbox | None, arguments: dict[str, Any]) -> tuple[str, bool]:
        text = arguments.get("text")
        if not isinstance(text, str) or not text:
            return "error: 'text' must be a non-empty string", False
        path = self._path(arguments, default=".")
        return self._run(sandbox, "search", text, path or ".")


class WriteFileTool(_FileTool):
    name = "write_file"
    description = "Replace the whole content of a text file (creates it if needed)"
    parameters = {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "file to write"},
                       "content": {"type": "string", "description": "the file's new content"}},
        "required": ["path", "content"],
    }

    # One-line files, as in examples/swe's starter tasks: SmolLM2-135M copies a one-line fix it was shown
    # into a well-formed call; a content with escaped newlines it garbled (examples/swe/README.md).
    demos = [
        ("greet(name) in greet.py returns 'Hi ' + name. Change it to return 'Hello, ' + name + '!'.",
         [("read_file", {"path": "greet.py"}, "def greet(name): return 'Hi ' + name\n"),
          ("write_file", {"path": "greet.py", "content": "def greet(name): return 'Hello, ' + name + '!'"},
           "wrote 46 characters to greet.py")],
         "Fixed: greet(name) now returns 'Hello, ' + name + '!'."),
        ("total(prices) in total.py returns len(prices). Change it to return sum(prices).",
         [("read_file", {"path": "total.py"}, "def total(prices): return len(prices)\n"),
          ("write_file", {"path": "total.py", "content": "def total(prices): return sum(prices)"},
           "wrote 37 characters to total.py")],
         "Fixed: total(prices) now returns sum(prices)."),
    ]

    def setup(self, sandbox: Sandbox | None) -> None:
        if sandbox is None:
            raise RuntimeError("the write_file tool needs a sandbox")

    def call(self, sandbox: Sandbox | None, arguments: dict[str, Any]) -> tuple[str, bool]:
        path, content = self._path(arguments), arguments.get("content")
        if path is None or not isinstance(content, str):
            return "error: 'path' must be a non-empty string and 'content' a string", False
        assert sandbox is not None
        try:
            sandbox.write_file(path, content.encode())
        except Exception as err:  # SandboxError: a path outside the sandbox, a full disk
            return f"error: {err}", False
        return f"wrote {len(content)} characters to {path}", True
