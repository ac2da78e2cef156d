"""The trajectory inspector: what the trainer trains on, token by token, in a browser.

``python -m rayrl.inspect RUN_DIR`` serves a local web app over a run directory (runs/<exp_id>/, as
a normal run writes it: rayrl/records.py); ``--export FILE.html`` writes the same page as one
self-contained file; ``--atif FILE.json`` exports the episodes as ATIF trajectories. Modules:
reader.py (reads a live or damaged run directory), server.py (aiohttp app), page.py (the one page,
served or exported), atif.py (the ATIF mapping). docs/inspector.md is the user guide.
"""
