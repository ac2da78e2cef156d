"""``python -m rayrl.inspect RUN_DIR [--text [--step N | --episode STEP:INDEX]] [--export FILE.html]
[--atif FILE.json [--session ID]] [--host H --port P]``

``--text`` prints the run in the terminal (its steps and one step's episodes, or with ``--episode`` one
episode's turns, tool calls and token view with masks: rayrl/inspect/text.py). Without ``--text``,
``--export`` or ``--atif`` it serves the inspector until interrupted and prints the URL to open
(loopback by default; bound elsewhere, the URL carries a session token). A path that is not a run
directory, a file it cannot write or a port it cannot bind ends with one line saying so and exit code
2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from rayrl.inspect.atif import export_atif
from rayrl.inspect.page import export_html
from rayrl.inspect.reader import RunDirError, RunReader
from rayrl.inspect.server import start
from rayrl.inspect.text import episode_view, run_view


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rayrl.inspect", description=__doc__.split("\n\n")[1])
    p.add_argument("run_dir", help="a run directory: runs/<exp_id>/")
    p.add_argument("--text", action="store_true", help="print the run in the terminal: steps and one step's episodes")
    p.add_argument("--step", type=int, help="with --text: list this step's episodes (default: the last)")
    p.add_argument("--episode", metavar="STEP:INDEX", help="with --text: one episode's turns, tool calls and tokens")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="with --text: colour trained and masked tokens (auto: when printing to a terminal)")
    p.add_argument("--prompt-chars", type=int, default=400, help="with --text --episode: the prompt's last N chars")
    p.add_argument("--export", metavar="FILE.html", help="write the inspector as one self-contained HTML file")
    p.add_argument("--atif", metavar="FILE.json", help="write the episodes as ATIF trajectories (a JSON array)")
    p.add_argument("--session", metavar="ID", help="with --atif: only this episode, as one trajectory object")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    p.add_argument("--token", help="session token required when bound beyond loopback (default: a random one)")
    args = p.parse_args(argv)
    if args.session and not args.atif:
        p.error("--session selects the episode for --atif; give --atif FILE.json too")
    if (args.step is not None or args.episode) and not args.text:
        p.error("--step and --episode select what --text prints; give --text too")
    if args.episode is not None:
        step, _, index = args.episode.partition(":")
        if not (step.isdigit() and index.isdigit()):
            p.error(f"--episode: expected STEP:INDEX (as the list shows, e.g. 3:5), got {args.episode!r}")
        args.episode = (int(step), int(index))
    return args


def _text(reader: RunReader, args: argparse.Namespace) -> str:
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    if args.episode is not None:
        return episode_view(reader, *args.episode, color=color, prompt_chars=max(args.prompt_chars, 0))
    return run_view(reader, args.step)


async def _serve(reader: RunReader, host: str, port: int, token: str | None) -> None:
    runner, url = await start(reader, host, port, token)
    print(f"rayrl inspector for {reader.path}: {url} (one episode: add #episode=STEP:INDEX)", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        reader = RunReader(args.run_dir)
        if args.text:
            try:
                print(_text(reader, args), end="" if args.episode else "\n", flush=True)
            except BrokenPipeError:  # piped into head or less, which stopped reading: not an error
                sys.stdout = open(os.devnull, "w")  # the interpreter flushes stdout at exit: let it flush nowhere
            return 0
        if args.export or args.atif:
            if args.export:
                counts = export_html(reader, args.export)
                print(f"wrote {args.export}: {counts['episodes']} episodes, {counts['with_tokens']} with token detail "
                      "(one episode: open it with #episode=STEP:INDEX after the file's address)")
            if args.atif:
                counts = export_atif(reader, args.atif, args.session)
                print(f"wrote {args.atif}: {counts['trajectories']} ATIF trajectories "
                      f"({counts['skipped']} episodes without a recorded tree skipped)")
            return 0
        try:
            asyncio.run(_serve(reader, args.host, args.port, args.token))
        except OSError as err:
            print(f"rayrl.inspect: cannot serve on {args.host}:{args.port}: {err.strerror or err}", file=sys.stderr)
            return 2
    except RunDirError as err:
        print(f"rayrl.inspect: {err}", file=sys.stderr)
        return 2
    except KeyError as err:
        print(f"rayrl.inspect: {err.args[0]}", file=sys.stderr)
        return 2
    except OSError as err:  # an output file that cannot be written
        print(f"rayrl.inspect: cannot write {err.filename or 'the output'}: {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
