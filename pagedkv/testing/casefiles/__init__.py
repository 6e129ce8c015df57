"""Case files: the JSON a failing property leaves behind, replayable on any machine.

- :mod:`.schema`: types, ranges, consistency and memory budget (torch-free, imports nothing it reads);
- :mod:`.reading`: reading an untrusted file in order (bytes, schema, backends a file may name);
- :mod:`.writing`: where files go (``$PAGEDKV_FAILURE_DIR``), their names, writing them atomically;
- ``regressions/``: the shipped case files every candidate runs.
"""
