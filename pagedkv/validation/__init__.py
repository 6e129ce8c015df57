"""Argument checks, run before any kernel launch and any write (a device-side assert poisons a CUDA process).

- ``arguments``: checks of single arguments: tensors, pools, block tables, lengths, features;
- ``attention_arguments``: the checks of a whole ``paged_attention`` call;
- ``calls``: the checks of whole ``gather`` / ``scatter`` / ``write_kv`` calls, and the public names;
- ``levels``: the validation levels an op's ``validate`` argument picks;
- ``overlap``: whether two tensors may address a common byte.

The rules, with the exception each raises: docs/validation.md.
"""
