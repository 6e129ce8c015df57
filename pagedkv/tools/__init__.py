"""What uses the gate (:mod:`pagedkv.testing`), never used by it.

- ``mutants``: shipped faulty backends and caches, generated source mutants, kill tables and rates;
- ``peers``: other projects' kernels adapted to the contract (PyTorch, vLLM, SGLang, transformers);
- ``fuzz``: long-running search workers sharing an example database;
- ``baseline``: the code a refactor replaces as a second oracle (its pytest hooks: entry point
  ``pagedkv_baseline``).
"""
