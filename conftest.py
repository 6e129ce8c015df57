"""This repository's own test configuration.

The pagedkv pytest plugin comes from the installed package's ``pytest11`` entry point; the ini key
``pagedkv_builtin = true`` (pyproject.toml) switches it on for this repository's tests and the
conformance suite over the built-in backends. Keeping this file at the root puts the root on
``sys.path``, so the tests import the repository's ``strategies`` face like any project's own package.
"""
