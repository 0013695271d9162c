"""Scaffolding that tests, benchmarks and the CI scripts share (never a test module, never part of the package).

``optimizations``: patch_trainer keywords that isolate one optimization. ``moe4bit_models``: 4-bit expert layouts
built from stock modules (the stand-in class itself is the package's ``leantrain.cli.tiny.Linear4bitMoeExperts``).
``layer_kernels_refs``: torch stand-ins for the Liger kernels. Importable as ``testkit.<module>`` wherever the repo
root is on the path: pytest puts it there (``pythonpath`` in pyproject.toml), benchmarks/gpu_run.sh exports it."""
