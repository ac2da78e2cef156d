"""The weight path from trainer to engines, in one place.

- ``wire.py``: the wire format (safetensors payloads, SGLang's handle payloads and flattened buckets,
  the allow-listed unpickler) and the receiving checks before anything is copied into a live model;
- ``files.py``: safetensors directories (what the disk transport writes and engines read);
- ``group.py``: the process group a trainer and engines form for broadcasts (both sides);
- ``transfer.py``: what every sender shares: ``connect`` / ``send`` / ``close``, buckets, versions;
- ``disk.py``, ``handles.py``, ``broadcast.py``: one sender per transport (a shared-memory path; CUDA IPC
  or shared-memory handles; a NCCL or gloo broadcast);
- ``plan.py``: which trainer rank feeds which engine over which transport, picked once from where the
  engines and ranks run.

The engine server's HTTP routes for these payloads are rayrl/engines/cpu/weight_routes.py.
"""
