"""``python -m pagedkv fuzz``: search workers that share an example database (:mod:`.databases`) and
run each property through :mod:`pagedkv.testing.execute` (:mod:`.workers`)."""
